"""The etcd keyspace and the records stored in it.

Under the cluster prefix (``[etcd] prefix``, e.g. ``/pegaflow/default``):

* ``nodes/<node_id>`` -> :class:`NodeRecord` (msgpack), attached to the node's lease.
* ``blocks/<namespace>/<hash hex>/<shard>`` -> :class:`BlockLocation` (msgpack),
  attached to the owning node's lease, so a dead node's entries vanish by themselves.
* ``election/<duty>``: election keys of singleton duties.
* ``epoch`` -> the cluster epoch: a random id (ascii hex, :func:`new_cluster_epoch`)
  created once by the first coordinator with a put-if-absent and never rewritten.  A
  coordinator that finds it changed or missing is looking at another etcd (rebuilt from
  empty, restored from a backup, or the prefix wiped) and reloads its index from scratch.

A block of a namespace is a hit only when every shard asked for is present.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pegaflow.errors import BadRequest
from pegaflow.protocol.codec import pack, unpack

_MAX_RECORD = 64 << 10


DISK_SLOT = -1
"""the ``slot`` of a block held on its node's disk tier, not in its memory pool (the
record keeps its five fields, so readers that know no tiers read it as before)"""


@dataclass(frozen=True, slots=True)
class BlockLocation:
    """Where one shard of one block lives: node, slot, generation, size, xxh3 checksum."""

    node: str
    slot: int
    gen: int
    size: int
    xxh3: int

    @property
    def tier(self) -> str:
        """Which of the node's tiers holds the block: ``memory`` or ``disk``."""
        return "disk" if self.slot == DISK_SLOT else "memory"

    def encode(self) -> bytes:
        return pack([self.node, self.slot, self.gen, self.size, self.xxh3])

    @classmethod
    def decode(cls, data: bytes) -> BlockLocation:
        v = unpack(data, _MAX_RECORD)
        if not isinstance(v, list) or len(v) != 5:
            raise BadRequest("malformed block location record")
        return cls(str(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4]))


@dataclass(slots=True)
class NodeRecord:
    """A storage node as published in etcd and shown by ``pegaflow status``."""

    node_id: str
    host: str
    ucx_port: int
    http: str = ""
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    started_at: float = 0.0
    version: str = ""
    pool_id: str = ""
    """the node's pool file's id (kept across restarts on the same pool file)"""
    same_host_lookups: int = 0
    """lookups the connectors on this node's host answered from this node alone (no
    coordinator saw them), as they reported them since the node started"""
    same_host_hit_blocks: int = 0
    """blocks those lookups found"""
    same_host_miss_blocks: int = 0
    """blocks those lookups asked for and did not find"""
    disk_capacity_bytes: int = 0
    """size of the node's disk tier (0: none)"""
    disk_used_bytes: int = 0
    """bytes its disk tier holds"""
    disk_blocks: int = 0
    """blocks on its disk tier"""
    pool_file: list[Any] = field(default_factory=list)
    """``[path, device, inode]`` of its pool file, when it lets clients on its host map
    it (``[node] local_access``); empty otherwise.  A client that can open that path as
    that very file is on the node's host, whatever its address (a pod in its own
    network namespace is): see :mod:`pegaflow.client.samehost`"""

    @property
    def ucx_address(self) -> str:
        return f"{self.host}:{self.ucx_port}"

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: Any) -> NodeRecord:
        if not isinstance(d, dict):
            raise BadRequest("malformed node record")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def encode(self) -> bytes:
        return pack(self.to_wire())

    @classmethod
    def decode(cls, data: bytes) -> NodeRecord:
        return cls.from_wire(unpack(data, _MAX_RECORD))


class Keyspace:
    """Builds the keys of one cluster prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.rstrip("/")
        self.nodes = f"{self.prefix}/nodes/"
        self.blocks = f"{self.prefix}/blocks/"
        self.election = f"{self.prefix}/election/"
        #: The cluster epoch key (see the module docstring).
        self.epoch_key = f"{self.prefix}/epoch".encode()

    def node_key(self, node_id: str) -> bytes:
        return f"{self.nodes}{node_id}".encode()

    def block_key(self, ns: str, block_hash: bytes, shard: int) -> bytes:
        return f"{self.blocks}{ns}/{block_hash.hex()}/{shard}".encode()


def new_cluster_epoch() -> bytes:
    """A fresh random value for the cluster epoch key."""
    return secrets.token_hex(16).encode()


def node_http_url(rec: dict[str, Any] | NodeRecord, scheme: str = "http") -> str | None:
    """``<scheme>://host:port`` of a node's endpoint, or None.  A wildcard bind address
    (``0.0.0.0``) is replaced by the node's data-plane host.  ``rec``: a node record or
    its status dict; ``scheme``: :func:`pegaflow.tls.http_scheme`."""
    if isinstance(rec, NodeRecord):
        http, data_host = rec.http, rec.host
    else:
        http, data_host = str(rec.get("http") or ""), str(rec.get("host") or "")
    host, sep, port = http.rpartition(":")
    if not sep or not port.isdigit():
        return None
    host = host.strip("[]")
    if host in ("0.0.0.0", "::", ""):
        host = data_host or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"
