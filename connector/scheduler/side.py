"""Scheduler side of the connector: a facade over lookups, handoffs and step plans.

Runs inside vLLM's scheduler (engine-core process).  Each vLLM hook forwards to one
room: :mod:`.lookups` (lookups, the cost model's claim), :mod:`.locating` (same-host
locates and pins), :mod:`.handoffwait` (the P/D handoff), :mod:`.planner` (loads, saves
and delayed frees of each step), :mod:`.warmup` (engine-start connections),
:mod:`.known` (blocks believed stored).  The only I/O is one lookup RPC per new
request, under a hard deadline and behind a circuit breaker, so a slow or dead cluster
costs the engine at most ``lookup_timeout_s`` per request and nothing at all while the
breaker is open.

Pure module: no vLLM import (requests and scheduler outputs are duck-typed), so the
bookkeeping is unit-tested with fakes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..discovery import LocalNodeFinder
from ..metadata import LoadJob, StepPlan, WorkerReport
from ..metrics import Counters
from ..report import SameHostReport
from ..settings import ConnectorSettings
from .costmodel import CostModel
from .handoffwait import HandoffWait
from .hybrid import GroupLayout
from .known import KnownBlocks
from .locating import Locator
from .lookups import Lookups
from .missreport import REPORT_TIMEOUT_S, MissReporter, Send
from .nsdiag import NamespaceCheck
from .planner import Planner
from .reqstate import Lookup, ReqState
from .schedclient import ClusterClient, LookupClient
from .warmup import WARM_UP_NS, WarmUp

__all__ = ["WARM_UP_NS", "KnownBlocks", "LookupClient", "SchedulerSide"]

logger = logging.getLogger("pegaflow.connector")


class SchedulerSide:
    """The scheduler-side state machine of :class:`~pegaflow.connector.PegaKVConnector`.

    Args:
        settings: connector settings.
        block_size: tokens per vLLM block.
        world_size: TP x PP ranks of this engine; a block is a hit only when all of
            its ``world_size`` shards are stored.
        client: lookup client (``None``: created lazily by ``client_factory``).
        namespace: returns the cache namespace (``None``: not known yet, ask again);
            called on first use because it depends on vLLM state initialised after
            the connector.
        counters: the counters to update.
        client_factory: builds the client on first use.
        clock: monotonic clock (tests inject one).
        device: the engine's device type (the cost model's prior depends on it).
        block_bytes: bytes of one block of one shard, as far as the scheduler can tell
            (the workers report the exact figure).
        first_steps_min_tokens: until the engine has run a step computing this many
            tokens of a request, a hit leaves at least that many to compute (0: no
            bound; see :func:`~pegaflow.connector.compat.first_steps_min_tokens`).
        factors: this engine's namespace factors (:func:`.nsdiag.factor_strings`), sent
            when a lookup finds nothing to learn whether another namespace has the model.
        layout: a hybrid model's KV cache groups (vLLM's hybrid KV cache manager; None:
            one group): what of each group is stored, looked up and loaded
            (:mod:`.hybrid`).
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        block_size: int,
        world_size: int,
        namespace: Callable[[], str | None],
        counters: Counters,
        client: LookupClient | None = None,
        client_factory: Callable[[], LookupClient] | None = None,
        clock: Callable[[], float] = time.monotonic,
        device: str = "cpu",
        block_bytes: int = 0,
        first_steps_min_tokens: int = 0,
        factors: Callable[[], Mapping[str, str]] = dict,
        layout: GroupLayout | None = None,
    ) -> None:
        self.settings = settings
        self.layout = layout
        self.first_steps_min_tokens = first_steps_min_tokens
        """a hit leaves this many tokens to compute until a step has computed as many"""
        self.block_size = block_size
        self.world_size = world_size
        self.shards = list(range(world_size))
        self._namespace_fn = namespace
        self._namespace: str | None = None
        self.counters = counters
        self._clock = clock
        self.cluster = ClusterClient(client, client_factory, clock)
        """the lookup client, made on first use"""
        self.known = KnownBlocks(settings.known_blocks)
        self.finder = LocalNodeFinder(settings.local_node, settings.rpc_timeout_s, announce=True)
        """the storage node on this host (``local_node``, else found at engine start)"""
        self.costs = CostModel(
            device, block_size, block_bytes or 1 << 20, enabled=settings.cost_model
        )
        """what loads from each source and prefills cost: decides what to claim"""
        self.same_host = SameHostReport(self._send_report)
        """the lookups answered by the local node alone, reported to it (no coordinator
        sees them; ``pegaflow status`` counts them in the cluster's hit rate)"""
        self.warm = WarmUp(settings, self.shards, self.cluster, self.finder, clock)
        self.locator = Locator(settings, world_size, self.cluster, self.finder, clock)
        self.lookups = Lookups(
            settings, world_size, counters, self.cluster, self.warm, self.locator,
            self.costs, self.known, self.same_host, clock,
            NamespaceCheck(factors, settings.rpc_timeout_s, clock),
        )  # fmt: skip
        self.handoffs = HandoffWait(
            settings, block_size, counters, self.lookups, self.locator, self.finder
        )
        self.planner = Planner(
            settings, block_size, counters, self.known, lambda: self.namespace,
            self.load_budget_s, layout,
        )  # fmt: skip
        self.miss_report = MissReporter(
            counters, self._miss_sender, lambda: self.namespace, self.lookups.misses.details,
            min(REPORT_TIMEOUT_S, settings.rpc_timeout_s),
        )  # fmt: skip
        """this engine's misses by cause, sent to a coordinator on the report timer"""
        self.lookup_breaker = self.lookups.breaker
        self.locate_breaker = self.locator.breaker

    @property
    def _client_factory(self) -> Callable[[], LookupClient] | None:
        return self.cluster.factory

    @_client_factory.setter
    def _client_factory(self, factory: Callable[[], LookupClient] | None) -> None:
        self.cluster.factory = factory

    @property
    def local_node(self) -> str:
        """The node on this host: ``local_node`` when set, else the one found at engine
        start ('' while none is known)."""
        return self.finder.node

    @property
    def namespace(self) -> str:
        """The cache namespace ('' when it could not be determined: connector inert)."""
        if self._namespace is None:
            try:
                ns = self._namespace_fn()
            except Exception:
                logger.exception("PegaFlow: cannot determine the cache namespace; connector off")
                ns = ""
            if ns is None:  # not determinable yet (vLLM not fully initialised): ask again
                return ""
            self._namespace = ns
        return self._namespace

    def start_warm_up(self) -> None:
        """:meth:`warm_up` on a background thread (engine start); lookups made before it
        is done wait for it, up to ``WARM_UP_WAIT_S``, rather than miss."""
        self.warm.start()

    def warm_up(self) -> None:
        """Find the node on this host (unless ``local_node`` names it), then connect to
        the coordinator and to that node now (see :mod:`.warmup`)."""
        self.warm.run()

    # ---- vLLM hooks ----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the cluster can supply, loaded async."""
        st = self.planner.state(request)
        if not self.settings.can_load:
            return 0, False
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False
        hashes = self.planner.keys(request)
        n = len(hashes) // self.planner.groups  # positions
        start = num_computed_tokens // bs
        if start >= n or (request.num_tokens - 1) // bs <= start:
            # no full block is left before the last token (which vLLM computes anyway):
            # e.g. vLLM's own prefix cache served the rest; no lookup to pay for
            return 0, False
        ns = self.namespace
        if not ns:
            return 0, False
        if self.layout is not None:
            return self._hybrid_hit(st, request, ns, hashes, start, n, num_computed_tokens)
        lk = st.lookup
        now = self._clock()
        ho = self.handoffs.read(st, ns, hashes, now)
        if ho is not None:
            lk, wait = self.handoffs.wait(st, ho, ns, hashes, start, now)
            if wait:
                return None, False
            if lk is None:
                return 0, False
        elif not (
            lk is not None
            and lk.start == start
            and lk.n_hashes == n
            and now - lk.at < self.settings.lookup_cache_s
        ):
            lk = self.lookups.lookup(st, ns, hashes, start)
            if lk is None:
                return 0, False
        if lk.hits <= 0:
            return 0, False
        if self.locator.all_local(lk):
            # layer-wise: loaded during the step that computes the rest, so vLLM must
            # have at least one token left to compute
            tokens = min(lk.hits * bs, (request.num_tokens - 1) // bs * bs - num_computed_tokens)
            tokens = self._leave_for_first_steps(request, num_computed_tokens, tokens)
            lk.sync = tokens > 0
            return (tokens, False) if tokens > 0 else (0, False)
        lk.sync = False
        tokens = self._leave_for_first_steps(request, num_computed_tokens, lk.hits * bs)
        return (tokens, True) if tokens > 0 else (0, False)

    def _hybrid_hit(
        self, st: ReqState, request: Any, ns: str, keys: list[bytes], start: int, n: int,
        computed: int,
    ) -> tuple[int, bool]:
        """A hybrid model's hit (loaded asynchronously: vLLM recomputes a failed load of
        several groups only before the step, as a failed request)."""
        lk = st.lookup
        if not (
            lk is not None
            and lk.start == start
            and lk.n_hashes == n
            and self._clock() - lk.at < self.settings.lookup_cache_s
        ):
            lk = st.lookup = self._hybrid_lookup(st, request, ns, keys, start, n, computed)
            if lk is None:
                return 0, False
        return (lk.hits * self.block_size, True) if lk.hits > 0 else (0, False)

    def _hybrid_lookup(
        self, st: ReqState, request: Any, ns: str, keys: list[bytes], start: int, n: int,
        computed: int,
    ) -> Lookup | None:
        """The full groups' longest run of positions, then the windows before its end,
        else before the last anchor (:mod:`.hybrid`); a hit never covers the last
        token: vLLM would back a whole-prompt hit up into a window not loaded."""
        lay = self.layout
        assert lay is not None
        bs = self.block_size
        first = self.lookups.lookup(
            st, ns, [lay.key(keys, s) for s in lay.full_slots(start, n)], 0, locate=False
        )
        if first is None:
            return None
        nf = len(lay.full)
        end = min(start + first.hits // nf, (request.num_tokens - 1) // bs)
        end = start + self._leave_for_first_steps(request, computed, (end - start) * bs) // bs
        hit = Lookup(first.at, start, n, 0, [])
        for e in lay.ends(start, end):
            slots = lay.window_slots(start, e)
            win = self.lookups.lookup_all(ns, [lay.key(keys, s) for s in slots])
            if win is None:
                continue
            k = (e - start) * nf
            hit.hits = e - start
            hit.slots = lay.full_slots(start, e) + slots
            hit.nodes = first.nodes[:k] + win.nodes
            if len(first.gens) >= k and len(win.gens) == len(slots):
                hit.gens = first.gens[:k] + win.gens
            if first.disk or win.disk:
                pad = [False] * k
                hit.disk = (first.disk[:k] + pad)[:k] + (win.disk or [False] * len(slots))
            break
        return hit

    def _leave_for_first_steps(self, request: Any, computed: int, tokens: int) -> int:
        """``tokens`` of a hit, whole blocks fewer where it would leave fewer than
        ``first_steps_min_tokens`` to compute in an engine that has not computed that
        many in one step yet."""
        need = self.first_steps_min_tokens
        if not need:
            return tokens
        short = need - (request.num_tokens - computed - tokens)
        if short <= 0:
            return tokens
        bs = self.block_size
        return max(0, tokens - -(-short // bs) * bs)

    def update_state_after_alloc(
        self, request: Any, block_ids: Any, num_external_tokens: int
    ) -> LoadJob | None:
        """Plan the load of the blocks vLLM just allocated for an external hit (the
        job, None when there is nothing to load)."""
        return self.planner.plan_load(request, block_ids, num_external_tokens)

    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """This step's :class:`StepPlan` (resets the pending loads and delayed frees)."""
        if self.first_steps_min_tokens:
            sched = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            if max(sched.values(), default=0) >= self.first_steps_min_tokens:
                self.first_steps_min_tokens = 0  # the engine's kernels are past it
        return self.planner.build_plan(scheduler_output, self.lookups.take_probes())

    def load_budget_s(self, tokens: int) -> float:
        """How long an asynchronous load of ``tokens`` may wait before vLLM computes them
        instead (``LoadJob.budget_s``): about what computing them takes."""
        s = self.settings
        return self.costs.load_budget_s(
            tokens, s.load_budget_factor, s.load_budget_min_s, s.transfer_timeout_s
        )

    def request_finished(self, request: Any) -> bool:
        """True when vLLM must keep the request's blocks until the worker copied them."""
        return self.planner.request_finished(request)

    def handoff_params(self, request: Any) -> dict[str, Any] | None:
        """A ``kv_producer``'s ``kv_transfer_params`` for a finished request: the
        :class:`~pegaflow.connector.handoff.Handoff` of the prompt blocks it saved or found stored
        (None: not a producer, or no full block)."""
        st = self.planner.reqs.get(request.request_id)
        if self.layout is not None:
            return None
        return self.handoffs.params(st, request, self.namespace)

    def learn(self, report: WorkerReport) -> None:
        """Feed the workers' measurements into the cost model."""
        if report.block_bytes:
            self.costs.set_block_bytes(report.block_bytes)
        if report.down_nodes:
            self.lookups.note_down(report.down_nodes)
        if report.unsaved:
            self.lookups.misses.note_unsaved(report.unsaved)
        for source, size, seconds in report.samples:
            if source == "compute":
                self.costs.observe_compute(size, seconds)
            else:
                self.costs.observe_load(source, size, seconds)

    def update_connector_output(self, report: WorkerReport | None) -> None:
        """Learn from the workers: failed saves may be saved again, failed loads too."""
        if report is None:
            return
        self.learn(report)
        self.planner.forget_failed(report)

    def has_state(self, req_id: str) -> bool:
        """Whether the request is tracked (tests)."""
        return req_id in self.planner.reqs

    def _send_report(self, node: str, lookups: int, asked: int, hits: int, timeout: float) -> None:
        """One :class:`SameHostReport` report to ``node`` (raises when it fails)."""
        client = self.cluster.get()
        if client is None:
            raise RuntimeError("no cluster client")
        client.report_lookups(node, lookups, asked, hits, timeout)

    def _miss_sender(self) -> Send | None:
        """The cluster client's ``report_misses`` (None: no client)."""
        return getattr(self.cluster.get(), "report_misses", None)

    def close(self) -> None:
        """Report the last same-host lookups and misses, then close the lookup client."""
        self.same_host.close()
        self.miss_report.send()
        self.cluster.close()
