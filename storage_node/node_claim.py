"""One node id, one live node: the check a storage node's publisher makes before it
first registers in etcd.

Before its first registration the publisher reads ``nodes/<id>``.  A record there under
a live lease is either this node's own previous process (killed without revoking its
lease, which expires one TTL later) or another live node that uses the same id.  The
record's ``pool_id`` tells them apart: the pool file's id is kept across restarts on
the same pool file, and a process that holds the pool file's lock knows the previous
holder is dead; so the same pool id means "take over now".  Any other pool id (another
host, or this host after its pool file was lost) means "wait": a dead node's lease runs
out within its TTL, while a live node keeps refreshing it; a refresh seen (its
remaining TTL going up, or a new lease) or a lease outliving its TTL means another live
node, and :meth:`NodeIdClaim.check` raises :class:`~pegaflow.inventory.NodeIdInUse`.
The first registration is then written only if the key was not written since the check
(a compare on its revision: :meth:`NodeIdClaim.register`), so two nodes that start at
the same moment cannot both win.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aetcd import rpc

from pegaflow.errors import NotFound, PegaError, Unavailable
from pegaflow.etcd import EtcdClient, put_op
from pegaflow.inventory import NodeIdInUse
from pegaflow.keys import NodeRecord

log = logging.getLogger(__name__)

_CLAIM_POLL_S = 0.5


class NodeIdClaim:
    """The claim of one node key (``nodes/<id>``) in etcd (see the module docstring).

    :attr:`rev` is the node key's revision when :meth:`check` last found it free (None
    before, and once the first registration is written).
    """

    def __init__(self, client: EtcdClient, node_key: bytes) -> None:
        self._client = client
        self._node_key = node_key
        self.rev: int | None = None

    async def check(self, record: NodeRecord) -> None:
        """Make sure no other live node is registered under ``record``'s node id (see
        the module docstring); notes the node key's revision (:attr:`rev`) for the
        first registration.  Raises NodeIdInUse, or PegaError when etcd cannot be
        asked."""
        node_id, ours = record.node_id, record.pool_id
        seen: tuple[int, int] | None = None  # (lease, remaining TTL) last seen
        deadline = 0.0
        while True:
            kv = await self._client.get(self._node_key)
            if kv is None or not kv.lease:
                self.rev = kv.mod_revision if kv is not None else 0
                return
            other = _decode_record(kv.value)
            if ours and other is not None and other.pool_id == ours:
                log.info(
                    "node %s: etcd still has this pool's previous process (lease %x, "
                    "expiring): taking over",
                    node_id,
                    kv.lease,
                )
                self.rev = kv.mod_revision
                return
            ttl = await self._lease_ttl(kv.lease)
            if ttl <= 0:
                self.rev = kv.mod_revision
                return
            where = f"{other.host}:{other.ucx_port}" if other is not None else "unknown address"
            if seen is None:
                deadline = time.monotonic() + ttl + 1.0
                log.info(
                    "node %s: the node id is registered by a process of another pool (%s, "
                    "lease %x, %d s left); waiting for it to expire (a restart after a "
                    "crash), a live node keeps it and this one is refused",
                    node_id,
                    where,
                    kv.lease,
                    ttl,
                )
            elif kv.lease != seen[0] or ttl > seen[1] or time.monotonic() > deadline:
                raise NodeIdInUse(
                    f"node id {node_id} is in use by a live node ({where}, lease {kv.lease:x} "
                    "kept alive): give each node its own [node] node_id"
                )
            seen = (kv.lease, ttl)
            await asyncio.sleep(_CLAIM_POLL_S)

    async def _lease_ttl(self, lease: int) -> int:
        """Seconds left of ``lease`` (<= 0 once expired)."""
        req = rpc.LeaseTimeToLiveRequest(ID=lease)
        try:
            r = await self._client.call(lambda s: s.lease.LeaseTimeToLive, req)
        except NotFound:
            return -1
        return int(r.TTL)

    async def register(self, record: NodeRecord, lease: int) -> None:
        """The first registration of ``record`` under ``lease``: written only if nobody
        wrote the node key since :meth:`check` found it free; else checks again (raises
        PegaError to be retried, or NodeIdInUse)."""
        unchanged = rpc.Compare(
            key=self._node_key, target=rpc.Compare.CompareTarget.MOD,
            result=rpc.Compare.EQUAL, mod_revision=self.rev or 0,
        )  # fmt: skip
        r = await self._client.txn(
            [put_op(self._node_key, record.encode(), lease)], compare=[unchanged]
        )
        if not r.succeeded:
            self.rev = None
            await self.check(record)
            raise Unavailable("the node key changed during registration; retrying")
        self.rev = None


def _decode_record(value: bytes) -> NodeRecord | None:
    try:
        return NodeRecord.decode(value)
    except (PegaError, TypeError, ValueError):
        return None
