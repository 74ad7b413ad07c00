"""Layer-wise loads of a step: queued before its forward pass, awaited per layer, checked after.

Loads that the forward pass waits for (synchronous ones) are queued before it, waited for
layer by layer, and checked after it.

The layer-wise capability of the pool-file medium.  :class:`LayerwiseLoads` (owned by a
worker, its :class:`LayerwiseHost`) queues the copies of the loads that a step's forward
pass waits for (``LoadJob.sync``) through the pool file of the node on this host
(:meth:`~.poolfile.PoolFileMedium.start_layerwise`), early when the
scheduler shares this process (:mod:`~pegaflow.connector.sameprocess`), and makes the forward
pass's CUDA stream wait for each layer's blocks (:meth:`~LayerwiseLoads.wait_layer`).  After the
forward pass it verifies and accounts the copies; the failed blocks go to the step's
load errors, answered at once or deferred to vLLM's first read
(:mod:`~pegaflow.connector.loadcheck`). With debug logging it also times such a step's forward pass
(device and CPU).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

import torch

from ..loadcheck import DeferredLoadErrors
from ..metadata import LOCAL, LoadJob, StepPlan
from ..policy import WARM_UP_WAIT_S
from ..settings import ConnectorSettings
from .base import LoadResult
from .kvio import KVBlockIO
from .poolfile import PoolFileMedium, SyncLoad

logger = logging.getLogger("pegaflow.connector")


def _timing_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


def _ms(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def _elapsed_ms(timing: tuple[Any, Any] | None) -> float | None:
    """The device time between a pair of timing events (waits for the second)."""
    if timing is None:
        return None
    timing[1].synchronize()
    return float(timing[0].elapsed_time(timing[1]))


class LayerwiseHost(Protocol):
    """What layer-wise loads use of the worker that owns them."""

    io: KVBlockIO | None
    settings: ConnectorSettings
    graph_tokens: int

    @property
    def pool(self) -> PoolFileMedium | None:
        """The pool-file medium of this host's node (None while not mapped)."""
        ...

    def pool_ready(self, timeout: float = 0.0) -> bool:
        """Whether the engine-start search for this host's node (and the mapping of its
        pool) is done, waiting up to ``timeout`` for it."""
        ...

    def get_client(self) -> Any:
        """The cluster client (None while it cannot be made)."""
        ...

    def follow_steps(self) -> None:
        """Make loads queued from now on wait for the GPU work queued so far."""
        ...

    def load_whole(self, ns: str, job: LoadJob, ok: list[bool]) -> None:
        """Load ``job`` whole through the media now, setting ``ok[i]`` per block."""
        ...

    def collect(self, result: LoadResult) -> None:
        """Learn from a load's result (its counters and cost-model samples)."""
        ...

    def settle_layerwise(self, job: LoadJob, ok: list[bool], t0: float) -> list[int]:
        """Account a checked layer-wise load (started at ``t0``); returns its failed
        block ids (the request's first failed block goes to the report)."""
        ...


class LayerwiseLoads:
    """The layer-wise loads of the steps of one worker.

    Runs on the engine's thread only.  Reads its worker's KV cache (``io``), the node's
    pool file and the cluster client, and hands each checked load's result back to the
    worker; loads that cannot go layer-wise run whole through the worker's media before
    the forward pass.

    Args:
        worker: the worker that owns it.
        defer_checks: answer a step's load errors deferred (:mod:`~pegaflow.connector.loadcheck`).
    """

    def __init__(self, worker: LayerwiseHost, defer_checks: bool = False) -> None:
        self._w = worker
        self.fwd_timing: tuple[Any, Any] | None = None
        """device timing of a step with layer-wise loads (debug log only)"""
        self._cpu_marks: list[float] | None = None
        """when the CPU reached each layer of such a step's forward pass (debug log only)"""
        self.sync_loads: list[tuple[LoadJob, Any, float]] = []
        """the layer-wise loads queued and not yet checked"""
        self.early: list[SyncLoad] = []
        """the layer-wise loads queued before their step (:meth:`prestart`,
        :meth:`prestart_job`), taken by the step whose plan holds their jobs"""
        self._planned: StepPlan | None = None
        """the plan whose early loads :meth:`prestart` completed, until its step takes
        them (another plan's loads wait for their own step meanwhile)"""
        self.defer_checks = defer_checks
        """answer load errors deferred (:mod:`~pegaflow.connector.loadcheck`); the connector sets
        it where vLLM's scheduler shares this process"""
        self._deferred: collections.deque[tuple[int, DeferredLoadErrors]] = collections.deque()
        self._steps = 0
        self._step_sizes: set[int] = set()
        """token counts of the steps run so far (a new one loads new kernels, see
        :meth:`_ahead`)"""

    # ---- the forward pass ------------------------------------------------------------

    def start_step(self, plan: StepPlan) -> None:
        """Queue the step's layer-wise loads (or take those :meth:`prestart` queued)."""
        sync = [j for j in plan.loads if j.sync]
        if sync or self.early:
            self._start_sync_loads(plan.namespace, sync, plan)
            if self._cpu_marks is not None:
                self._cpu_marks.append(time.perf_counter())

    def begin_forward(self, plan: StepPlan, sync: bool) -> None:
        """The step's forward pass starts now (``sync``: it waits on layer-wise loads);
        with debug logging, time it."""
        self._step_sizes.add(plan.tokens)
        io = self._w.io
        self.fwd_timing = None
        on_gpu = io is not None and io.device.type == "cuda"
        self._cpu_marks = None
        if sync and on_gpu and logger.isEnabledFor(logging.DEBUG):
            self.fwd_timing = (_timing_event(), _timing_event())
            self.fwd_timing[0].record()
            self._cpu_marks = [time.perf_counter()]

    def end_forward(self) -> None:
        """The step's forward pass was issued."""
        if self.fwd_timing is not None:
            self.fwd_timing[1].record()
        if self._cpu_marks is not None:
            self._log_cpu_marks(self._cpu_marks, time.perf_counter())

    @staticmethod
    def _log_cpu_marks(marks: list[float], end: float) -> None:
        """Debug: where the CPU spent the issue of a forward pass with layer-wise loads
        (ms from the step's start to its loads queued, to each eighth of the layers, and
        to the end of the forward pass), and its slowest layer."""
        t0 = marks[0]
        layers = marks[2:]  # marks[1]: the loads queued
        if not layers:
            return
        gaps = [b - a for a, b in zip(marks[1:], layers, strict=False)]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        picks = sorted({0, *range(len(layers) // 8, len(layers), max(1, len(layers) // 8))})
        logger.debug(
            "PegaFlow: forward issue (CPU, ms from the step's start): loads queued %.1f, "
            "%s, end %.1f; slowest layer %d (%.1f ms)",
            (marks[1] - t0) * 1e3,
            ", ".join(f"layer {i} {(layers[i] - t0) * 1e3:.1f}" for i in picks),
            (end - t0) * 1e3, worst, gaps[worst] * 1e3,
        )  # fmt: skip

    # ---- queuing ---------------------------------------------------------------------

    def prestart(self, plan: StepPlan) -> None:
        """Queue the copies of a step's layer-wise loads as soon as the scheduler in
        this process planned it (:mod:`~pegaflow.connector.sameprocess`); :meth:`start_step` then
        takes them instead of queuing them.  Loads :meth:`prestart_job` queued already are
        left alone.  Does nothing unless the node's pool file is mapped and the cache
        is on a GPU, nor in a step with preemptions (their blocks may be reallocated
        before :meth:`WorkerSide.wait_for_copies`); a failure leaves the loads to
        :meth:`start_step`."""
        if plan.preempted or not self._w.settings.early_start:
            return  # preempted: blocks still being copied out may be given to new requests
        if self._planned is not None:
            return  # a plan not yet taken by its step: this one starts in its own step
        early = {id(j) for j, _p, _t in self.early}
        sync = [j for j in plan.loads if j.sync and id(j) not in early]
        self._queue_early(plan.namespace, sync, self._ahead(plan))
        if self.early:
            self._planned = plan

    def prestart_job(self, job: LoadJob, ns: str) -> None:
        """Queue the copies of one request's layer-wise load the moment vLLM's scheduler
        in this process allocated its blocks, while it goes on to look up the step's
        other requests (each lookup a round trip to the node): the copy engines then
        start on the first request of a batch instead of after the last one's lookup.
        Only where vLLM replays CUDA graphs: in an eager engine, the first kernel of a
        new shape waits for every copy in flight (:meth:`_ahead`), so its steps queue
        their loads when planned, a few layers ahead of the forward pass."""
        if job.sync and self._w.graph_tokens and self._w.settings.early_start:
            if self._planned is None:  # else: a plan not yet taken by its step
                self._queue_early(ns, [job], 0)

    def _queue_early(self, ns: str, jobs: list[LoadJob], ahead: int) -> None:
        """Queue ``jobs``' copies now, into :attr:`early` (see :meth:`prestart`)."""
        w = self._w
        io, pool = w.io, w.pool
        if not jobs or io is None or io.device.type != "cuda" or pool is None:
            return
        if not ns or not w.pool_ready():
            return
        try:
            client = w.get_client()
            if client is None:
                return
            w.follow_steps()
            loads, res = pool.start_layerwise(client, ns, jobs, time.monotonic(), ahead)
            self.early.extend(loads)
            w.collect(res)
        except Exception as e:  # the step starts them itself
            logger.warning("PegaFlow: early start of a step's loads failed: %s", e)

    def _ahead(self, plan: StepPlan) -> int:
        """How many layers of a step's layer-wise loads to queue ahead of its forward
        pass (0: all at once).  The first GEMM of a shape the engine has not run picks a
        cuBLAS kernel that CUDA loads lazily, and loading it synchronizes the context:
        the CPU then waits for every copy in flight before it issues the rest of the
        forward pass (measured on the H200: 130-180 ms in a batch of eight hits).  In
        a step of a new size only ``load_lookahead_layers`` go ahead, the rest as the
        forward pass reaches them; not in a step that replays a CUDA graph, whose
        kernels were loaded when vLLM captured it."""
        if plan.tokens in self._step_sizes or plan.tokens <= self._w.graph_tokens:
            return 0
        return self._w.settings.load_lookahead_layers

    def _take_prestarted(self, plan: StepPlan) -> list[SyncLoad]:
        """The loads queued early for ``plan``; those of another plan (vLLM did not run
        the step it planned) are checked with this step's."""
        self._planned = None
        if not self.early:
            return []
        mine = {id(j) for j in plan.loads}
        started = [x for x in self.early if id(x[0]) in mine]
        stale = [x for x in self.early if id(x[0]) not in mine]
        self.early = []
        if stale:
            logger.debug("PegaFlow: %d early loads of a step vLLM did not run", len(stale))
            self.sync_loads.extend(stale)
        return started

    def _start_sync_loads(self, ns: str, jobs: list[LoadJob], plan: StepPlan) -> None:
        """Queue the copies of the loads that this step's forward pass waits for, layer
        by layer (:meth:`wait_layer`), all of them at once so that their copies go
        layer-major (:meth:`PoolFileMedium.start_layerwise`), unless :meth:`prestart`
        did; verified and reported by :meth:`finish`."""
        w = self._w
        t0 = time.monotonic()
        started = self._take_prestarted(plan)
        early = {id(j) for j, _p, _t in started}
        jobs = [j for j in jobs if id(j) not in early]
        self.sync_loads.extend(started)
        if not jobs:
            return
        w.pool_ready(WARM_UP_WAIT_S)  # a request right after engine start
        pool, client = w.pool, w.get_client()
        started = []
        if pool is not None and client is not None and w.io is not None and ns:
            started, res = pool.start_layerwise(client, ns, jobs, t0, self._ahead(plan))
            w.collect(res)
        self.sync_loads.extend(started)
        taken = {id(j) for j, _p, _t in started}
        for job in jobs:
            if id(job) in taken:
                continue
            # no local pool here after all: load now, whole, before the forward runs
            ok = [False] * len(job.block_ids)
            try:
                w.load_whole(ns, job, ok)
            except Exception:
                logger.exception("PegaFlow: load of %s failed", job.req_id)
            self.sync_loads.append((job, ok, t0))

    def wait_layer(self, layer_name: str) -> None:
        """Make the forward pass (its CUDA stream) wait until ``layer_name``'s blocks
        of this step's layer-wise loads are in; never blocks the CPU."""
        io = self._w.io
        if not self.sync_loads or io is None:
            return
        if self._cpu_marks is not None:
            self._cpu_marks.append(time.perf_counter())
        idx = io.layer_of.get(layer_name)
        for _job, pending, _t0 in self.sync_loads:
            if isinstance(pending, list):
                continue
            if idx is None:
                pending.transfer.wait_all()
            else:
                pending.transfer.wait_layer(idx)

    # ---- checking --------------------------------------------------------------------

    def finish(self) -> set[int]:
        """Verify and account the layer-wise loads queued so far; returns the failed
        block ids."""
        loads, self.sync_loads = self.sync_loads, []
        return self._check_sync_loads(loads, time.monotonic(), self.fwd_timing)

    def _check_sync_loads(
        self, loads: list[tuple[LoadJob, Any, float]], issued: float, fwd: Any
    ) -> set[int]:
        """Wait for ``loads``' copies (their step was issued at ``issued``), verify and
        account them; returns the failed block ids (each request's first failed block
        goes to the report)."""
        w = self._w
        out: set[int] = set()
        for job, pending, t0 in loads:
            res = LoadResult()
            if isinstance(pending, list):
                ok = pending
            else:
                try:
                    t1 = max(issued, t0 + pending.queued_s)
                    ok = pending.finish()
                    t2 = time.monotonic()
                    res.count("layerwise_wait_seconds", t2 - t1)
                    res.count("local_load_blocks", sum(ok))
                    if w.io is not None and any(ok) and pending.learn:
                        # what the load costs: its copies' time on the device where
                        # known, not the wait, which holds the step's other work too
                        busy = pending.transfer.busy_s()
                        spent = t2 - t1 if busy is None else busy
                        nbytes = sum(ok) * w.io.block_bytes
                        res.samples.append((LOCAL, nbytes, pending.queued_s + spent))
                    if logger.isEnabledFor(logging.DEBUG):
                        logger.debug(
                            "PegaFlow: layer-wise load of %s: %d of %d blocks, located %s, "
                            "queued in %.2f ms, forward pass %.2f ms, then checked %.2f ms "
                            "later; on the device: the step's copies %s ms, its forward %s ms",
                            job.req_id, sum(ok), len(ok),
                            "here" if pending.located_here else "by the scheduler",
                            pending.queued_s * 1e3, (t1 - t0 - pending.queued_s) * 1e3,
                            (t2 - t1) * 1e3, _ms(pending.transfer.device_ms()),
                            _ms(_elapsed_ms(fwd)),
                        )  # fmt: skip
                except Exception as e:
                    logger.warning("PegaFlow: layer-wise load of %s failed: %s", job.req_id, e)
                    ok = [False] * len(job.block_ids)
            res.count("layerwise_load_jobs")
            w.collect(res)
            out.update(w.settle_layerwise(job, ok, t0))
        return out

    def take_load_errors(self, take_errors: Callable[[], set[int]]) -> AbstractSet[int]:
        """The step's load errors: ``take_errors()`` (the worker's other load errors)
        and those of its layer-wise loads; deferred with :attr:`defer_checks` (see
        :meth:`WorkerSide.take_load_errors`)."""
        self._settle_deferred()
        loads, self.sync_loads = self.sync_loads, []
        errs = take_errors()
        if not loads:
            return errs
        issued, fwd = time.monotonic(), self.fwd_timing
        if not self.defer_checks:
            return errs | self._check_sync_loads(loads, issued, fwd)
        deferred = DeferredLoadErrors(lambda: errs | self._check_sync_loads(loads, issued, fwd))
        self._deferred.append((self._steps, deferred))
        return deferred

    def _settle_deferred(self, force: bool = False) -> None:
        """Forget checked deferred answers; check those vLLM should have read by now
        (two steps on: its batch queue holds two) and stop deferring if it did not
        read one (that vLLM reads outputs otherwise), or all of them with ``force``."""
        self._steps += 1
        while self._deferred:
            step, d = self._deferred[0]
            if not d.checked and not force and step > self._steps - 3:
                break
            self._deferred.popleft()
            if not d.checked:
                d.read_first_by_vllm = False
                d.resolve()
                if not force and self.defer_checks:
                    self.defer_checks = False
                    logger.warning(
                        "PegaFlow: vLLM did not read a step's load errors within two steps; "
                        "this vLLM schedules differently from the versions tested: load "
                        "checks now wait at the end of each step instead"
                    )

    def close(self) -> set[int]:
        """At shutdown: check the loads planned and never run (their pins go back) and
        every deferred answer; returns the failed block ids of the former."""
        failed: set[int] = set()
        if self.early:  # planned, never run: checked, their pins go back
            self.sync_loads.extend(self.early)
            self.early = []
            self._planned = None
            failed = self.finish()
        self._settle_deferred(force=True)  # their pins go back now
        return failed
