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
from ..namespace import block_hashes_bytes, group_keys
from ..settings import ConnectorSettings
from .hybrid import GroupLayout, Slot
from .known import KnownBlocks
from .reqstate import Lookup, ReqState, per_group

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
        layout: a hybrid model's KV cache groups (vLLM's hybrid KV cache manager; None:
            one group): each position of a request is a block per group, keyed by
            :func:`~pegaflow.connector.namespace.group_keys`, stored and loaded as
            :mod:`.hybrid` says (a state group's blocks where vLLM names a kept state).
            vLLM frees a sliding-window or state group's blocks while their request
            runs: one given to a request while its save may still be copying makes the
            step wait for that copy first (as a preemption does).
    """

    settings: ConnectorSettings
    block_size: int
    counters: Counters
    known: KnownBlocks
    namespace: InitVar[Callable[[], str]]
    budget: InitVar[Callable[[int], float] | None] = None
    layout: GroupLayout | None = None

    def __post_init__(
        self, namespace: Callable[[], str], budget: Callable[[int], float] | None
    ) -> None:
        self._namespace = namespace
        self._budget = budget
        self.reqs: dict[str, ReqState] = {}
        """the tracked requests by id, from their first lookup until they finish"""
        self._pending_loads: list[LoadJob] = []
        self._delay_free: list[str] = []
        self.groups = self.layout.groups if self.layout is not None else 1
        self._window_saved: dict[int, str] = {}
        """block id of a window group -> the request that saved it (until vLLM gives
        the block out again)"""
        self._fence: list[str] = []
        """requests whose copies must finish before the next step (see ``layout``)"""

    def keys(self, request: Any) -> list[bytes]:
        """The storage keys of ``request``'s blocks (every group's, interleaved), grown
        as vLLM hashes more of its blocks."""
        st = self.state(request)
        hashes = request.block_hashes
        have = len(st.keys) // self.groups
        if have < len(hashes):
            st.keys.extend(group_keys(block_hashes_bytes(hashes[have:]), self.groups))
        return st.keys

    def _check_reuse(self, ids: Any) -> None:
        """Fence the step where vLLM gave out again a window group's block whose save
        may still be copying."""
        saved = self._window_saved
        if not saved:  # also: no window groups
            return
        for group in ids:
            for b in group:
                owner = saved.pop(b, None)
                if owner is not None and owner not in self._fence:
                    self._fence.append(owner)

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
        lk = st.lookup
        st.lookup = None
        ids = per_group(block_ids, self.groups)
        if self.layout is not None:
            job = self._plan_hybrid_load(st, ids, num_external_tokens, lk)
        else:
            job = self._plan_one_group_load(st, ids[0], num_external_tokens, lk)
        if self._budget is not None and not job.sync:
            job.budget_s = self._budget(num_external_tokens)
        self._pending_loads.append(job)
        st.loading = not job.sync
        self.counters.add("hit_tokens", num_external_tokens)
        return job

    def _plan_one_group_load(
        self, st: ReqState, ids: list[int], num_external_tokens: int, lk: Lookup | None
    ) -> LoadJob:
        request = st.request
        n_load = -(-num_external_tokens // self.block_size)
        keys = self.keys(request)
        if lk is None or n_load > lk.hits or len(ids) < lk.start + n_load:
            start = lk.start if lk is not None else max(0, len(ids) - n_load)
            self._unexpected(request, num_external_tokens)
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
            hashes=keys[start : start + n_load],
            nodes=nodes,
            first_block=start,
            sync=lk is not None and lk.sync,
            gens=gens,
            disk=lk.disk[:n_load] if lk is not None and n_load <= lk.hits else [],
            located=located,
            pins=list(lk.pins) if lk is not None and located else [],
            located_at=lk.located_at if lk is not None else 0.0,
        )
        if len(job.block_ids) != n_load or len(job.hashes) != n_load:
            job.nodes = [[] for _ in job.block_ids]
            job.hashes = (job.hashes + [b"\0"] * len(job.block_ids))[: len(job.block_ids)]
        return job

    def _plan_hybrid_load(
        self, st: ReqState, ids: list[list[int]], num_external_tokens: int, lk: Lookup | None
    ) -> LoadJob:
        """A hybrid model's load: the blocks of the hit's slots (every full group's, the
        window groups' windows), into exactly the blocks vLLM allocated for them."""
        assert self.layout is not None
        self._check_reuse(ids)
        request = st.request
        n_load = -(-num_external_tokens // self.block_size)
        slots: list[Slot]
        if lk is None or lk.hits != n_load or any(p >= len(ids[g]) for p, g in lk.slots):
            start = lk.start if lk is not None else max(0, len(ids[0]) - n_load)
            self._unexpected(request, num_external_tokens)
            slots = self.layout.full_slots(start, min(start + n_load, *map(len, ids)))
            nodes: list[list[str]] = [[] for _ in slots]
            gens: list[list[int]] = []
            disk: list[bool] = []
        else:
            start, slots, nodes, gens, disk = lk.start, lk.slots, lk.nodes, lk.gens, lk.disk
        keys = self.keys(request)
        job = LoadJob(
            req_id=request.request_id,
            block_ids=[ids[g][p] for p, g in slots],
            hashes=[self.layout.key(keys, slot) for slot in slots],
            nodes=nodes,
            first_block=start * self.groups,
            gens=gens,
            disk=disk,
        )
        if any(self.layout.is_state(g) and ids[g][p] <= 0 for p, g in slots):
            logger.warning(
                "PegaFlow: vLLM gave no block for a state of %s's hit; reporting its load "
                "failed (the request is computed)",
                request.request_id,
            )
            job.nodes = [[] for _ in slots]
        _skip_null_blocks(job)
        return job

    @staticmethod
    def _unexpected(request: Any, tokens: int) -> None:
        """vLLM asked for a load not offered: it is answered with failures, never KV."""
        logger.error(
            "PegaFlow: unexpected load of %d tokens for %s; reporting it failed",
            tokens,
            request.request_id,
        )

    def build_plan(self, scheduler_output: Any, probes: list[LoadJob]) -> StepPlan:
        """This step's :class:`StepPlan`, with ``probes`` after the planned loads
        (resets the pending loads and delayed frees)."""
        so = scheduler_output
        plan = StepPlan(namespace=self._namespace() if self.reqs or self._pending_loads else "")
        plan.loads, self._pending_loads = self._pending_loads, []
        g = self.groups
        if probes:
            plan.loads += probes
        num_sched: dict[str, int] = dict(getattr(so, "num_scheduled_tokens", {}) or {})
        plan.tokens = int(sum(num_sched.values()))
        spec: dict[str, Any] = dict(getattr(so, "scheduled_spec_decode_tokens", {}) or {})

        for nr in getattr(so, "scheduled_new_reqs", ()) or ():
            st = self.reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = per_group(nr.block_ids, g)
            self._check_reuse(st.block_ids)
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
                new = per_group(nb, g)
                if rid in resumed or not st.block_ids:
                    st.block_ids = new
                elif nb:
                    for mine, more in zip(st.block_ids, new, strict=True):
                        mine.extend(more)
                self._check_reuse(new)
                st.loading = False
                after = cached.num_computed_tokens[i] + num_sched.get(rid, 0)
                after -= len(spec.get(rid, ()) or ())
                self._plan_save(plan, rid, st, after)

        if self.layout is not None and self.layout.states:
            self._plan_state_saves(plan, so)

        for rid in getattr(so, "preempted_req_ids", None) or ():
            st = self.reqs.get(rid)
            if st is not None:
                st.block_ids = []
            plan.preempted.append(rid)

        for rid in self._fence:
            if rid not in plan.preempted:
                plan.preempted.append(rid)
        self._fence = []
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
        keys = self.keys(req)
        g = self.groups
        full = min(limit // self.block_size, len(keys) // g, *map(len, st.block_ids))
        if full <= st.next_save:
            return
        lo, st.next_save = st.next_save, full
        if not self.settings.saves_prompt:  # a consumer's prompt blocks are its producer's
            lo = max(lo, int(getattr(req, "num_prompt_tokens", 0)) // self.block_size)
        if not self._namespace():
            return
        lay = self.layout
        slots = lay.save_slots(lo, full) if lay is not None else [(i, 0) for i in range(lo, full)]
        self._save(plan, rid, st, [
            (bid, keys[i * g + group], lay is not None and lay.windows[group] > 0)
            for i, group in slots
            if (bid := st.block_ids[group][i]) > 0  # else vLLM's null block: nothing to save
        ])  # fmt: skip

    def _save(
        self, plan: StepPlan, rid: str, st: ReqState, blocks: list[tuple[int, bytes, bool]]
    ) -> None:
        """Plan the save of ``blocks`` (block id, key, whether vLLM may give the block out
        again while its request runs: then fenced), those known stored left out."""
        ids: list[int] = []
        hs: list[bytes] = []
        for bid, h, fenced in blocks:
            if h in self.known:
                self.counters.add("save_known_blocks")
                continue
            self.known.add(h)
            ids.append(bid)
            hs.append(h)
            if fenced:
                self._window_saved[bid] = rid
        if ids:
            plan.saves.append(SaveJob(rid, ids, hs))
            st.saved_any = True
            self.counters.add("save_planned_blocks", len(ids))

    def _plan_state_saves(self, plan: StepPlan, so: Any) -> None:
        """Save the states vLLM committed at block boundaries since the last step: it
        names each one's block (``kv_connector_block_state.boundary_state_offloads``:
        ``(group, block id, boundary tokens)`` by request), as a state group's block
        table is no positional record (vLLM nulls and moves its blocks)."""
        lay = self.layout
        assert lay is not None
        state = getattr(so, "kv_connector_block_state", None)
        offloads = getattr(state, "boundary_state_offloads", None) or {}
        if not offloads or not self.settings.can_save or not self._namespace():
            return
        g, bs = self.groups, self.block_size
        logger.debug("PegaFlow: states vLLM kept: %s", offloads)
        for rid, handed in offloads.items():
            st = self.reqs.get(rid)
            if st is None:
                continue
            req = st.request
            keys = self.keys(req)
            limit = len(keys) // g * bs
            if not self.settings.save_decode_blocks:
                limit = min(limit, int(getattr(req, "num_prompt_tokens", limit)))
            first = 0 if self.settings.saves_prompt else int(getattr(req, "num_prompt_tokens", 0))
            self._save(plan, rid, st, [
                (bid, lay.key(keys, (boundary // bs - 1, group)), True)
                for group, bid, boundary in handed
                if 0 <= group < g and lay.is_state(group) and bid > 0
                and boundary % bs == 0 and first < boundary <= limit  # else: no key names it
            ])  # fmt: skip

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
            for h in self.keys(st.request)[idx:]:
                self.known.discard(h)


def _skip_null_blocks(job: LoadJob) -> None:
    """Drop from a hybrid load the blocks vLLM gave its null block (before a sliding
    window, which attention skips): nothing to load there."""
    keep = [j for j, b in enumerate(job.block_ids) if b > 0]
    if len(keep) == len(job.block_ids):
        return
    job.block_ids = [job.block_ids[j] for j in keep]
    job.hashes = [job.hashes[j] for j in keep]
    job.nodes = [job.nodes[j] for j in keep]
    if job.gens:
        job.gens = [job.gens[j] for j in keep]
    if job.disk:
        job.disk = [job.disk[j] for j in keep if j < len(job.disk)]
