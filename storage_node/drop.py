"""``drop``: an operator removes one namespace's blocks from the node.

Every committed block of the namespace leaves the pool: it is unpublished from the
index (through the node's eviction path: the same unpublish and journal record as an
eviction) and its slot is freed.  A block pinned by a read in flight (a ``get``'s send,
a read pin, a same-host reader's ``locate``) is dropped once its pins go: the node
looks again every :data:`RETRY_S` until none is left.  Reservations in flight are not
touched; blocks committed after the drop stay.  A same-host reader that located a
block just before it went checks what it copied, as it does against an eviction.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pegaflow.storage_node.blocks import Entry

from pegaflow.keys import BlockLocation
from pegaflow.protocol import node as proto

if TYPE_CHECKING:
    from pegaflow.storage_node.node_service import NodeService
    from pegaflow.storage_node.sessions import Handler, Session

log = logging.getLogger(__name__)

RETRY_S = 0.05
"""how often pinned blocks of a drop are looked at again"""


def drop_op(service: NodeService) -> Handler:
    """The service's handler of ``drop``."""

    def drop(msg: dict[str, Any], s: Session) -> dict[str, Any]:
        ns = proto.decode_drop(msg)
        pool = service.pool
        mine = [e for e in list(pool.committed()) if e.key[0] == ns]
        on_disk = _drop_from_disk(service, ns)
        pinned = _drop_unpinned(service, mine)
        if pinned:
            service.loop.call_later(RETRY_S, _again, service, ns, pinned)
        log.info(
            "drop of namespace %r: %d blocks dropped (%d copies on the disk tier), %d pinned "
            "ones dropped once their pins go",
            ns, len(mine) - len(pinned), on_disk, len(pinned),
        )  # fmt: skip
        return proto.encode_drop_reply(proto.Dropped(len(mine) - len(pinned), len(pinned)))

    return drop


def _drop_from_disk(service: NodeService, ns: str) -> int:
    """Remove the namespace's copies on the disk tier (a read in flight keeps its slot
    until it ends); unpublish those not also in memory (the pool's drop does the rest).
    Returns how many there were."""
    disk = service.disk
    if disk is None:
        return 0
    n = 0
    for key in [k for k in disk.keys() if k[0] == ns]:
        if disk.discard(key):
            n += 1
            if service.pool.get(key) is None:
                service.sink.unpublish(
                    ns, key[1], key[2], BlockLocation(service.pool.node_id, 0, 0, 0, 0)
                )
    return n


def _drop_unpinned(service: NodeService, entries: list[Entry]) -> list[Entry]:
    """Drop those of ``entries`` not pinned; returns the pinned ones still stored."""
    pool = service.pool
    left = []
    for e in entries:
        if pool.get(e.key) is not e:
            continue  # evicted or dropped meanwhile
        if e.pins:
            left.append(e)
        else:
            pool.drop(e)
    return left


def _again(service: NodeService, ns: str, entries: list[Entry]) -> None:
    left = _drop_unpinned(service, entries)
    if left:
        service.loop.call_later(RETRY_S, _again, service, ns, left)
    else:
        log.info("drop of namespace %r: its last pinned blocks are dropped", ns)
