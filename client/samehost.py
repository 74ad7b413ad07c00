"""Finding the storage nodes on this host: a node counts as one when this process can open
its pool file as the very file the node described (the same-host shortcut maps that
file instead of moving bytes over UCX).

Which nodes to ask: a node publishes its pool file's path, device and inode in its
record (:attr:`~pegaflow.keys.NodeRecord.pool_file`), so a client tries to open that
path and asks only the nodes whose file it opened as that very file
(:func:`may_be_here`): no connection to the other nodes of a large cluster, and no
reliance on addresses, which a pod in its own network namespace does not share with
its host although it maps the host's ``/dev/shm``.  A record without it (a node of an
older version) falls back to the address check (:func:`on_this_host`)."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pegaflow.deadline import Deadline
from pegaflow.errors import PegaError, Unavailable, WrongPeer
from pegaflow.keys import NodeRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolFile:
    """Where a node keeps its pool (offered to same-host clients in the handshake)."""

    path: str
    dev: int
    ino: int
    size: int
    control: str | None = None
    """the node's same-host control socket (see :mod:`pegaflow.client.session`), if any"""
    slab: int = 0
    """the pool's slab size (no block spans two slabs; 0: not said, an older node)"""

    @property
    def file_id(self) -> tuple[int, int]:
        """(device, inode): which file this is (a same-host reservation names it)."""
        return self.dev, self.ino

    @classmethod
    def from_wire(cls, d: Any) -> PoolFile | None:
        if not isinstance(d, dict):
            return None
        try:
            control = d.get("control")
            return cls(
                str(d["path"]),
                int(d["dev"]),
                int(d["ino"]),
                int(d["bytes"]),
                control if isinstance(control, str) and control else None,
                int(d.get("slab", 0)),
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class LocalNode:
    """A storage node on this host: its record and the pool file this process can open."""

    record: NodeRecord
    pool: PoolFile


def open_pool_file(info: PoolFile, flags: int = os.O_RDWR) -> int:
    """Open a node's pool file and check that it is the file the node described (same
    device and inode, at least as large); returns the descriptor (the caller closes it).

    Raises ``OSError`` when it cannot be opened or is another file: another host's path,
    another mount namespace's ``/dev/shm``, a pool replaced since the node described it.
    """
    fd = os.open(info.path, flags)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (info.dev, info.ino) or st.st_size < info.size:
            raise OSError(f"{info.path} is not the node's pool file (another host's?)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def on_this_host(host: str) -> bool:
    """Whether ``host`` (a node's data-plane address) can be an address of this machine.

    An IP address is this machine's when a socket can bind to it (a local system call:
    nothing is sent); a name only when it is ``localhost`` or this machine's host name
    (names are not resolved: no DNS query per node).  The pool file check that follows
    (:func:`open_pool_file`) is what decides; this only spares connecting to every
    node of a large cluster.
    """
    host = host.strip().strip("[]")
    if not host:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        name = host.lower().rstrip(".")
        mine = socket.gethostname().lower()
        return name in ("localhost", mine) or name.split(".")[0] == mine.split(".")[0]
    if ip.is_unspecified or ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
    except OSError as e:
        if e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            log.debug("cannot tell whether %s is an address of this host: %s", host, e)
        return False
    return True


def may_be_here(rec: NodeRecord) -> bool:
    """Whether node ``rec`` may be on this host (see the module docstring): its published
    pool file opens here as that very file, or, for a record without one, its address
    may be this machine's.  The pool file offered in the node's handshake decides."""
    if len(rec.pool_file) == 3:
        path, dev, ino = rec.pool_file
        try:
            return opens_as_node_file(PoolFile(str(path), int(dev), int(ino), 0))
        except (TypeError, ValueError):
            return False
    return on_this_host(rec.host)


def opens_as_node_file(info: PoolFile) -> bool:
    """Whether this process can open ``info`` as the node's pool file
    (:func:`open_pool_file`)."""
    try:
        os.close(open_pool_file(info))
    except OSError:
        return False
    return True


async def nodes_here(
    records: Iterable[NodeRecord],
    hello: Callable[[NodeRecord], Awaitable[PoolFile | None]],
    deadline: Deadline,
) -> list[LocalNode]:
    """The nodes of ``records`` on this host: those whose published pool file opens here
    as that file (:func:`may_be_here`: no other node is asked), and whose pool file
    offered in their ``hello`` (the data-plane handshake) does too.  Largest pool first,
    then by id.  A node whose hello fails is left out (one that another node answers
    for is logged at WARNING, see :class:`~pegaflow.errors.WrongPeer`); raises
    ``Unavailable`` when the hellos run past ``deadline``."""

    async def probe(rec: NodeRecord) -> LocalNode | None:
        try:
            pool = await hello(rec)
        except WrongPeer as e:
            log.warning("node %s left out of this host's nodes: %s", rec.node_id, e)
            return None
        except PegaError as e:
            log.debug("node %s (%s): no handshake: %s", rec.node_id, rec.ucx_address, e)
            return None
        if pool is None or not opens_as_node_file(pool):
            return None
        return LocalNode(rec, pool)

    candidates = [r for r in records if may_be_here(r)]
    if not candidates:
        return []
    try:
        got = await asyncio.wait_for(
            asyncio.gather(*(probe(r) for r in candidates)), deadline.left()
        )
    except TimeoutError:
        raise Unavailable("nodes on this host did not answer within the deadline") from None
    found = [n for n in got if n is not None]
    found.sort(key=lambda n: (-n.record.capacity_bytes, n.record.node_id))
    return found
