"""Nodes clients cannot reach: left out of lookups for a while, cluster-wide.

For one lease TTL after a node is cut off or hangs, its lease keeps its blocks in the
index and every client that looks them up would wait on the node before computing.  A
client whose gets to a node fail (:mod:`pegaflow.client.nodehealth`) stops asking it at
once and reports it here (``report_unreachable``, at most once a second per client and
node).  Unless this coordinator reaches the node itself (its HTTP ``/health``, within
:data:`CHECK_TIMEOUT_S`; a client partitioned from a node the coordinator reaches is
protected by its own memory, and the others go on loading from it), the node's blocks
are left out of every lookup's answer, as if not stored (a hit ends before its first
block on the node), for ``[coordinator] suspect_ttl_s``, renewed by every further
report, and ended early when the node answers the coordinator's check again (tried every
:data:`CHECK_EVERY_S`).  Kept in memory only: each coordinator learns from the clients
that use it, and a restarted coordinator starts with none.

``report_unreachable`` ``{node}`` -> ``{suspected: bool}`` (whether lookups now leave the
node out).  Only the cluster's own connections may report (a tenant's is refused, by
the op's entry in :data:`~pegaflow.protocol.coordinator.OPS`: one tenant must not hide a
node from the others).  Counted by
``pegaflow_coordinator_unreachable_reports_total{result}``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import InitVar, dataclass
from typing import Any

import aiohttp

from pegaflow.keys import NodeRecord, node_http_url
from pegaflow.protocol.coordinator import decode_report_unreachable
from pegaflow.tls import http_scheme

from .index import BlockIndex

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 0.5
"""how long the coordinator's check of a node's /health may take"""
CHECK_EVERY_S = 1.0
"""how often a suspected node is checked again"""


async def http_alive(
    rec: NodeRecord, timeout: float = CHECK_TIMEOUT_S, tls: ssl.SSLContext | None = None
) -> bool | None:
    """Whether the node answers its HTTP ``/health`` within ``timeout`` (None: it has
    no HTTP endpoint to ask); ``tls``: over HTTPS, verified by this context."""
    base = node_http_url(rec, http_scheme(tls))
    if base is None:
        return None
    try:
        t = aiohttp.ClientTimeout(total=timeout)
        url = base + "/health"
        async with aiohttp.ClientSession(timeout=t) as s, s.get(url, ssl=tls or True) as r:
            await r.read()
            return True  # it answered (even 503, not ready): the process runs
    except (TimeoutError, aiohttp.ClientError, OSError):
        return False


@dataclass(eq=False, repr=False)
class Suspects:
    """The nodes lookups leave out now (see the module docstring).

    Args:
        index: the index whose lookups leave them out.
        ttl_s: how long one report holds (0: reports are only counted).
        counts: ``pegaflow_coordinator_unreachable_reports_total`` by result.
        alive: the check of a node (tests inject one).
        clock: monotonic clock.
    """

    index: BlockIndex
    ttl_s: float
    counts: dict[str, int]
    alive: InitVar[Callable[[NodeRecord], Awaitable[bool | None]]] = http_alive
    clock: InitVar[Callable[[], float]] = time.monotonic

    def __post_init__(
        self, alive: Callable[[NodeRecord], Awaitable[bool | None]], clock: Callable[[], float]
    ) -> None:
        self._alive = alive
        self._clock = clock
        self._until: dict[str, float] = {}
        self._watch: asyncio.Task[None] | None = None

    def _count(self, result: str) -> None:
        self.counts[result] = self.counts.get(result, 0) + 1

    async def op_report(self, args: dict[str, Any]) -> dict[str, Any]:
        """The ``report_unreachable`` op."""
        return {"suspected": await self.report(decode_report_unreachable(args))}

    async def report(self, node_id: str) -> bool:
        """A client cannot reach ``node_id``: whether lookups now leave it out."""
        rec = next((n for n in self.index.nodes() if n.node_id == node_id), None)
        if rec is None:
            self._count("unknown")
            return False
        now = self._clock()
        if node_id in self._until:  # renewed without a new check (one runs every second)
            self._until[node_id] = now + self.ttl_s
            self._count("suspected")
            return True
        if self.ttl_s <= 0 or await self._alive(rec):
            self._count("alive")
            return False
        self._until[node_id] = self._clock() + self.ttl_s
        self._count("suspected")
        self._apply()
        log.warning(
            "node %s reported unreachable and does not answer this coordinator either: its "
            "blocks are left out of lookups (computed instead) until it answers, for %.0f s "
            "at most unless reported again",
            node_id, self.ttl_s,
        )  # fmt: skip
        if self._watch is None or self._watch.done():
            self._watch = asyncio.ensure_future(self._run())
        return True

    @property
    def nodes(self) -> frozenset[str]:
        """The nodes left out now."""
        return frozenset(self._until)

    def _apply(self) -> None:
        self.index.set_suspects(frozenset(self._until))

    def _drop(self, node_id: str, why: str) -> None:
        if self._until.pop(node_id, None) is not None:
            self._apply()
            log.warning("node %s is back in lookups (%s)", node_id, why)

    async def _run(self) -> None:
        """While some node is left out: end what expired, check the others again."""
        while self._until:
            await asyncio.sleep(CHECK_EVERY_S)
            now = self._clock()
            for node_id, until in list(self._until.items()):
                if now >= until:
                    self._drop(node_id, "no report renewed it")
                    continue
                rec = next((n for n in self.index.nodes() if n.node_id == node_id), None)
                if rec is None:
                    self._drop(node_id, "it left the cluster")
                elif await self._alive(rec):
                    self._drop(node_id, "it answers this coordinator again")

    async def close(self) -> None:
        """Stop the checks."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
