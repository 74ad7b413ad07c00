"""The scheduler's step plan: the loads, saves and delayed frees of each vLLM step.

vLLM allocates blocks for an external hit (``update_state_after_alloc``: a load is
planned), schedules a step (``build_plan``: the blocks computed since the last save are
planned for saving, skipping those known stored), and finishes requests (their blocks
wait for the workers' copies before vLLM frees them).  Everything here is bookkeeping
on block indices and hashes: no I/O.

Pure module: no vLLM import (scheduler outputs are duck-typed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import InitVar, dataclass
from typing import Any

from pegaflow.observability import telemetry
from pegaflow.protocol.codec import LocatedBlocks

from ..metadata import LoadJob, SaveJob, StepPlan, WorkerReport
from ..metrics import Counters
from ..namespace import block_hash_bytes, block_hashes_bytes
from ..settings import ConnectorSettings
from .known import KnownBlocks
from .reqstate import ReqState, group0

logger = logging.getLogger("pegaflow.connector")


@dataclass(eq=False, repr=False)
class Planner:
    """The requests the scheduler side tracks and the plan of each step for them.

    Args:
        settings: connector settings.
        block_size: tokens per vLLM block.
        counters: the counters to update.
        known: the known-blocks cache (saves skip known blocks).
        namespace: the cache namespace ('' while not known).
        budget: how long a load of that many tokens may wait (``LoadJob.budget_s``;
            None: no budget, ``transfer_timeout_s``).
    """

    settings: ConnectorSettings
    block_size: int
    counters: Counters
    known: KnownBlocks
    namespace: InitVar[Callable[[], str]]
    budget: InitVar[Callable[[int], float] | None] = None

    def __post_init__(
        self, namespace: Callable[[], str], budget: Callable[[int], float] | None
    ) -> None:
        self._namespace = namespace
        self._budget = budget
        self.reqs: dict[str, ReqState] = {}
        """the tracked requests by id, from their first lookup until they finish"""
        self._pending_loads: list[LoadJob] = []
        self._delay_free: list[str] = []

    def state(self, request: Any) -> ReqState:
        """The request's state (tracked from now on if it was not)."""
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = ReqState(request)
        else:
            st.request = request
        return st

    def plan_load(self, request: Any, block_ids: Any, num_external_tokens: int) -> LoadJob | None:
        """Plan the load of the blocks vLLM just allocated for an external hit (the job,
        None when there is nothing to load)."""
        st = self.state(request)
        if num_external_tokens <= 0:
            return None
        ids = group0(block_ids)
        bs = self.block_size
        n_load = -(-num_external_tokens // bs)
        lk = st.lookup
        st.lookup = None
        hashes = request.block_hashes
        if lk is None or n_load > lk.hits or len(ids) < lk.start + n_load:
            # vLLM asked for a load we did not offer: answer it with failures, never KV
            start = lk.start if lk is not None else max(0, len(ids) - n_load)
            logger.error(
                "PegaFlow: unexpected load of %d tokens for %s; reporting it failed",
                num_external_tokens,
                request.request_id,
            )
            nodes: list[list[str]] = [[] for _ in range(n_load)]
            gens: list[list[int]] = []
            located: list[LocatedBlocks] = []
        else:
            start = lk.start
            nodes = lk.nodes[:n_load]
            gens = lk.gens[:n_load]
            located = [where[:n_load] for where in lk.located]
        job = LoadJob(
            req_id=request.request_id,
            block_ids=list(ids[start : start + n_load]),
            hashes=block_hashes_bytes(hashes[start : start + n_load]),
            nodes=nodes,
            first_block=start,
            sync=lk is not None and lk.sync,
            gens=gens,
            disk=lk.disk[:n_load] if lk is not None and n_load <= lk.hits else [],
            located=located,
            pins=list(lk.pins) if lk is not None and located else [],
            located_at=lk.located_at if lk is not None else 0.0,
        )
        if self._budget is not None and not job.sync:
            job.budget_s = self._budget(num_external_tokens)
        if len(job.block_ids) != n_load or len(job.hashes) != n_load:
            job.nodes = [[] for _ in job.block_ids]
            job.hashes = (job.hashes + [b"\0"] * len(job.block_ids))[: len(job.block_ids)]
        self._pending_loads.append(job)
        st.loading = not job.sync
        self.counters.add("hit_tokens", num_external_tokens)
        return job

    def build_plan(self, scheduler_output: Any, probes: list[LoadJob]) -> StepPlan:
        """This step's :class:`StepPlan`, with ``probes`` after the planned loads
        (resets the pending loads and delayed frees)."""
        so = scheduler_output
        plan = StepPlan(namespace=self._namespace() if self.reqs or self._pending_loads else "")
        plan.loads, self._pending_loads = self._pending_loads, []
        if probes:
            plan.loads += probes
        num_sched: dict[str, int] = dict(getattr(so, "num_scheduled_tokens", {}) or {})
        plan.tokens = int(sum(num_sched.values()))
        spec: dict[str, Any] = dict(getattr(so, "scheduled_spec_decode_tokens", {}) or {})

        for nr in getattr(so, "scheduled_new_reqs", ()) or ():
            st = self.reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = group0(nr.block_ids)
            st.loading = False
            after = nr.num_computed_tokens + num_sched.get(nr.req_id, 0)
            after -= len(spec.get(nr.req_id, ()) or ())
            self._plan_save(plan, nr.req_id, st, after)

        cached = getattr(so, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
            for i, rid in enumerate(cached.req_ids):
                st = self.reqs.get(rid)
                if st is None:
                    continue
                nb = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
                if rid in resumed:
                    st.block_ids = group0(nb) if nb else []
                elif nb:
                    st.block_ids.extend(group0(nb))
                st.loading = False
                after = cached.num_computed_tokens[i] + num_sched.get(rid, 0)
                after -= len(spec.get(rid, ()) or ())
                self._plan_save(plan, rid, st, after)

        for rid in getattr(so, "preempted_req_ids", None) or ():
            st = self.reqs.get(rid)
            if st is not None:
                st.block_ids = []
            plan.preempted.append(rid)

        plan.delay_free, self._delay_free = self._delay_free, []
        for rid in getattr(so, "finished_req_ids", ()) or ():
            self.reqs.pop(rid, None)
        if plan.saves or plan.loads:
            plan.namespace = self._namespace()
        return plan

    def _plan_save(self, plan: StepPlan, rid: str, st: ReqState, computed_after: int) -> None:
        if not self.settings.can_save:
            return
        req = st.request
        limit = computed_after
        if not self.settings.save_decode_blocks:
            limit = min(limit, int(getattr(req, "num_prompt_tokens", limit)))
        hashes = req.block_hashes
        full = min(limit // self.block_size, len(hashes), len(st.block_ids))
        if full <= st.next_save:
            return
        lo, st.next_save = st.next_save, full
        if not self.settings.saves_prompt:  # a consumer's prompt blocks are its producer's
            lo = max(lo, int(getattr(req, "num_prompt_tokens", 0)) // self.block_size)
        if not self._namespace():
            return
        ids: list[int] = []
        hs: list[bytes] = []
        for i in range(lo, full):
            h = block_hash_bytes(hashes[i])
            bid = st.block_ids[i]
            if bid <= 0:  # vLLM's null block: nothing to save
                continue
            if h in self.known:
                self.counters.add("save_known_blocks")
                continue
            self.known.add(h)
            ids.append(bid)
            hs.append(h)
        if ids:
            plan.saves.append(SaveJob(rid, ids, hs))
            st.saved_any = True
            self.counters.add("save_planned_blocks", len(ids))

    def request_finished(self, request: Any) -> bool:
        """True when vLLM must keep the request's blocks until the worker copied them."""
        st = self.reqs.get(request.request_id)
        if st is not None and telemetry.tracing:
            hits = st.lookup.hits if st.lookup is not None else 0
            telemetry.request_root(request.request_id, st.started_ns, {"pegaflow.hit_blocks": hits})
        if st is None or not st.saved_any or st.loading:
            return False
        self._delay_free.append(request.request_id)
        return True

    def forget_failed(self, report: WorkerReport) -> None:
        """Blocks whose save or load failed are no longer known: they may be saved again."""
        for h in report.save_failed:
            self.known.discard(h)
        for rid, idx in report.load_failed.items():
            st = self.reqs.get(rid)
            if st is None:
                continue
            for h in st.request.block_hashes[idx:]:
                self.known.discard(block_hash_bytes(h))
