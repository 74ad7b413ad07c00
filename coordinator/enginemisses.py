"""Why the engines' lookups missed, as the engines tell it: their ``miss_report``\\ s.

The coordinator's own view (:mod:`.evictions`) knows what its index knows; an engine
also knows that its cost model declined a hit, that its lookup failed, that its own save
was dropped or refused by a quota.  Each engine's connector (its scheduler side,
:mod:`pegaflow.connector.scheduler.missreport`) sends a coordinator the blocks its
lookups missed since its last report, by cause, every ``report_interval_s`` when it has
any.  :class:`EngineMisses` keeps, in memory only (a status display, rebuilt as engines
report again after a restart):

* per engine (its tenant, namespace, host and pid), the blocks missed by cause since its first
  report here, and the last detail of each cause; an engine that has not
  reported for :data:`FORGET_S` is forgotten, and past :data:`MAX_ENGINES` the one that
  reported least recently is;
* the total since this coordinator started, forgotten engines included (the Prometheus
  counter ``pegaflow_coordinator_engine_miss_blocks_total{cause}``).

With several coordinators an engine reports to the one its client talks to: each
coordinator's status shows the engines that report to it.  A tenant's connection may
report for its own namespaces only (as for every op naming ``ns``); its engines are
kept apart from the cluster's and other tenants' (``tenant`` in the status document).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pegaflow.protocol.coordinator import MissReport
from pegaflow.transport.rpc_server import current_tenant

MAX_ENGINES = 1024
"""engines kept (the least recently reporting one is forgotten first)"""
FORGET_S = 600.0
"""seconds without a report after which an engine is forgotten (an engine with misses
reports every ``report_interval_s``, 10 s by default)"""


@dataclass(slots=True)
class _Engine:
    seen: float
    """monotonic time of its last report"""
    seen_wall: float
    blocks: dict[str, int] = field(default_factory=dict)


@dataclass
class EngineMisses:
    """The engines' miss reports (see the module docstring)."""

    max_engines: int = MAX_ENGINES
    """engines kept"""
    forget_s: float = FORGET_S
    """seconds without a report before an engine is forgotten"""
    clock: Callable[[], float] = time.monotonic
    """monotonic clock"""
    total: dict[str, int] = field(default_factory=dict)
    """blocks the engines reported missed since start, by cause"""
    details: dict[str, str] = field(default_factory=dict)
    """the last detail reported of each cause"""
    _engines: OrderedDict[tuple[str, str, str, int], _Engine] = field(
        default_factory=OrderedDict, init=False
    )
    """(tenant, ns, host, pid) -> its record, least recently reporting first"""

    def op_report(self, args: dict[str, Any]) -> dict[str, Any]:
        """The ``miss_report`` op, for the tenant of the connection that sent it."""
        return self.report(MissReport.from_wire(args), current_tenant() or "")

    def report(self, rep: MissReport, tenant: str = "") -> dict[str, Any]:
        """Add ``rep`` from ``tenant`` ('' the cluster); the reply: engines kept."""
        now = self.clock()
        self._forget(now)
        key = (tenant, rep.ns, rep.host, rep.pid)
        eng = self._engines.pop(key, None) or _Engine(now, time.time())
        eng.seen, eng.seen_wall = now, time.time()
        self._engines[key] = eng
        while len(self._engines) > self.max_engines:
            self._engines.popitem(last=False)
        for cause, n in rep.blocks.items():
            eng.blocks[cause] = eng.blocks.get(cause, 0) + n
            self.total[cause] = self.total.get(cause, 0) + n
        self.details.update(rep.details)
        return {"engines": len(self._engines)}

    def _forget(self, now: float) -> None:
        engines = self._engines
        while engines and next(iter(engines.values())).seen <= now - self.forget_s:
            engines.popitem(last=False)

    def status(self) -> dict[str, Any]:
        """The status document's part: ``engines`` (each reporting engine: ``ns``,
        ``host``, ``pid``, ``tenant``, ``last_seen_s``, ``miss_blocks_by_cause``),
        ``engine_miss_blocks_by_cause`` (the total since start) and
        ``engine_miss_details`` (the last detail of each cause)."""
        self._forget(self.clock())
        wall = time.time()
        engines = [
            {
                "ns": ns, "host": host, "pid": pid, "tenant": tenant,
                "last_seen_s": round(wall - e.seen_wall, 3),
                "miss_blocks_by_cause": dict(sorted(e.blocks.items())),
            }
            for (tenant, ns, host, pid), e in sorted(self._engines.items())
        ]  # fmt: skip
        return {
            "engines": engines,
            "engine_miss_blocks_by_cause": dict(sorted(self.total.items())),
            "engine_miss_details": dict(sorted(self.details.items())),
        }
