"""A client's memory of the nodes that failed it: no call waits on a node known to be cut off.

For one lease TTL after a node is cut off or hangs, the index still names it, and every
get to it would wait out its whole deadline before its caller recomputes.  So a client
remembers, by node id, each node that a get failed on by timeout or a lost connection
(not a plain miss: a node that answered "not stored" answered).  Gets to a node it
remembers are answered as misses at once, without sending anything, until the node
answers again: a hello on a new connection, tried in the background every
:data:`RETRY_S` (:meth:`~.api.PegaClient` runs the probe), or a record of the node with
another address (it restarted elsewhere).

The client also tells the coordinators (``report_unreachable``, at most once per
:data:`REPORT_EVERY_S` per node), which leave the node's blocks out of every client's
lookups for a while (``[coordinator] suspect_ttl_s``) unless they can reach it
themselves: the cluster-wide part, see :mod:`pegaflow.coordinator.suspects`.

Thread-safe: the connector's scheduler (another thread of the process) asks
:meth:`NodeHealth.is_down` to decline hits on a node at once.  No I/O of its own:
:func:`watch_down` drives the client's probes and reports.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pegaflow.errors import PegaError

log = logging.getLogger("pegaflow.client.nodehealth")

RETRY_S = 1.0
"""how often a node that failed is tried again (a hello on a new connection)"""
PROBE_TIMEOUT_S = 1.0
"""how long one such hello may take"""
REPORT_EVERY_S = 1.0
"""least time between two reports of one node to the coordinators (per client)"""
LOG_EVERY_S = 10.0
"""least time between two warnings about one node"""


@dataclass
class Suspect:
    """A node that failed a get of this client."""

    node_id: str
    since: float
    address: str
    """the address it failed at ('' when unknown): a record with another clears it"""
    why: str
    reported_at: float = -1e18
    probes: int = 0


class NodeHealth:
    """Which nodes failed this client and have not answered since (see the module
    docstring).  ``clock``: monotonic clock (tests inject one)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._down: dict[str, Suspect] = {}
        self._answered: set[str] = set()
        self._logged: dict[tuple[str, bool], float] = {}
        self.skipped_blocks = 0
        """blocks of gets answered as misses at once because their node was down"""
        self.failures = 0
        """times a node was marked down"""

    # ---- queries (any thread) --------------------------------------------------------

    def is_down(self, node_id: str) -> bool:
        """Whether ``node_id`` failed this client and has not answered since."""
        return node_id in self._down

    def down(self) -> frozenset[str]:
        """The nodes down now (a snapshot)."""
        return frozenset(self._down)

    def has_answered(self, node_id: str) -> bool:
        """Whether ``node_id`` answered this client at least once (its connection is set
        up: a get to it then costs a transfer, not a connection's set-up too)."""
        return node_id in self._answered

    def suspects(self) -> list[Suspect]:
        """The nodes down now, with their details (a snapshot)."""
        with self._lock:
            return list(self._down.values())

    # ---- events ----------------------------------------------------------------------

    def skip(self, blocks: int) -> None:
        """``blocks`` of a get were answered as misses at once (their node is down)."""
        with self._lock:
            self.skipped_blocks += blocks

    def failed(self, node_id: str, address: str, why: str) -> bool:
        """A get to ``node_id`` (at ``address``) failed by timeout or a lost connection:
        it is down from now on.  True when it was not down before."""
        now = self._clock()
        with self._lock:
            if node_id in self._down:
                return False
            self._down[node_id] = Suspect(node_id, now, address, why)
            self.failures += 1
        self._warn(
            node_id,
            True,
            "PegaFlow: node %s is unreachable (%s); loads from node %s are skipped and "
            "their blocks computed instead, until it answers again (tried every %.0f s)",
            node_id, why, node_id, RETRY_S,
        )  # fmt: skip
        return True

    def answered(self, node_id: str) -> bool:
        """``node_id`` answered (a get, or a hello): it is up.  True when it was down."""
        now = self._clock()
        with self._lock:
            self._answered.add(node_id)
            s = self._down.pop(node_id, None)
        if s is None:
            return False
        self._warn(
            node_id,
            False,
            "PegaFlow: node %s answers again after %.1f s; loads from it resume",
            node_id, now - s.since,
        )  # fmt: skip
        return True

    def moved(self, node_id: str, address: str) -> bool:
        """A record of ``node_id`` names ``address``: a node down at another address
        (restarted elsewhere) is tried again.  True when that cleared it."""
        s = self._down.get(node_id)
        if s is None or not s.address or not address or s.address == address:
            return False
        return self.answered(node_id)

    def due_reports(self) -> list[str]:
        """The nodes down now whose report to the coordinators is due (marked sent)."""
        now = self._clock()
        out = []
        with self._lock:
            for s in self._down.values():
                if now - s.reported_at >= REPORT_EVERY_S:
                    s.reported_at = now
                    out.append(s.node_id)
        return out

    def _warn(self, node_id: str, down: bool, msg: str, *args: object) -> None:
        """A warning, at most one per :data:`LOG_EVERY_S` per node and direction (a
        flapping node logs a few lines, not one per request)."""
        now = self._clock()
        key = (node_id, down)
        with self._lock:
            if now - self._logged.get(key, -1e18) < LOG_EVERY_S:
                return
            self._logged[key] = now
        log.warning(msg, *args)


async def watch_down(
    health: NodeHealth,
    refresh: Callable[[], Awaitable[object]],
    probe: Callable[[str], Awaitable[object]],
    report: Callable[[str], Awaitable[object]],
) -> None:
    """While some node of ``health`` is down: ``report`` it to the coordinators
    (rate-limited per node) and ``probe`` it again every :data:`RETRY_S` (a hello on a
    new connection, at the address of its latest record, which ``refresh`` learns anew
    every ``5 * RETRY_S``: a node may have moved); ends when none is down."""
    refreshed = 0.0
    while health.down():
        if time.monotonic() - refreshed > 5 * RETRY_S:
            refreshed = time.monotonic()
            try:
                await refresh()
            except PegaError:
                pass
        await asyncio.gather(
            *(report(nid) for nid in health.due_reports()),
            *(probe(s.node_id) for s in health.suspects()),
        )
        await asyncio.sleep(RETRY_S)
