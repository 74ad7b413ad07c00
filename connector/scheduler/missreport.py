"""This engine's misses by cause, sent to a coordinator for ``pegaflow status``.

The scheduler side counts each lookup's missed blocks by cause (:mod:`.misscause`,
``miss_blocks.<cause>``); some causes only the engine knows (declined by the cost model,
a failed lookup, its own save dropped or refused by a quota).  :meth:`MissReporter.send`
runs on the ``PegaFlow cache:`` line's timer (every ``report_interval_s``, never on a
lookup's path): it sends a coordinator the blocks missed since the last report, with the
last detail of each cause and the engine's namespace, host and pid (``miss_report``:
:mod:`pegaflow.coordinator.enginemisses`), under a deadline of at most
:data:`REPORT_TIMEOUT_S`.  Nothing is sent when nothing new missed; a report that fails
is logged at DEBUG and its blocks are sent with the next one (one that timed out after
reaching the coordinator may so be counted twice).

Pure module: no vLLM import.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pegaflow.protocol.coordinator import MissReport

from ..metrics import Counters

logger = logging.getLogger("pegaflow.connector")

REPORT_TIMEOUT_S = 2.0
"""longest deadline of one report (the client's ``rpc_timeout_s`` when shorter)"""
PREFIX = "miss_blocks."

Send = Callable[[MissReport, float], object]
"""``send(report, timeout)``: one report to a coordinator, or raises"""


@dataclass
class MissReporter:
    """Sends the engine's ``miss_blocks.<cause>`` counters' growth (see the module
    docstring)."""

    counters: Counters
    """the scheduler side's counters"""
    sender: Callable[[], Send | None]
    """the sender of one report (None while there is no cluster client: nothing sent)"""
    namespace: Callable[[], str]
    """the engine's namespace ('' while not known: nothing sent)"""
    details: Callable[[], Mapping[str, str]]
    """the last detail seen of each cause"""
    timeout_s: float = REPORT_TIMEOUT_S
    """deadline of one report"""
    engine: tuple[str, int] = field(default_factory=lambda: (socket.gethostname(), os.getpid()))
    """this engine's host and pid"""
    _sent: dict[str, int] = field(default_factory=dict, init=False)
    """``miss_blocks.<cause>`` totals the coordinator has taken so far, by cause"""
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def pending(self) -> dict[str, int]:
        """Blocks missed since the last report that reached the coordinator, by cause."""
        with self._lock:
            return self._pending()

    def send(self) -> bool:
        """Send what is pending now; True when nothing is left unsent."""
        with self._lock:  # one report at a time (the timer's, or the last at shutdown)
            blocks = self._pending()
            if not blocks:
                return True
            ns, send = self.namespace(), self.sender()
            if not ns or send is None:
                return False
            details = {c: d for c, d in self.details().items() if c in blocks}
            try:
                send(MissReport(ns, *self.engine, blocks, details), self.timeout_s)
            except Exception as e:
                logger.debug("PegaFlow: reporting misses to the coordinator failed: %s", e)
                return False
            for c, n in blocks.items():
                self._sent[c] = self._sent.get(c, 0) + n
            return True

    def _pending(self) -> dict[str, int]:
        totals = self.counters.totals()
        sent = self._sent
        now = {k[len(PREFIX):]: int(v) for k, v in totals.items() if k.startswith(PREFIX)}
        return {c: n - sent.get(c, 0) for c, n in now.items() if n > sent.get(c, 0)}
