"""Worker side of the connector: async loads into the KV cache, async saves out of it.

Runs in every vLLM worker (one per TP/PP rank); each rank moves only its own shard.

Loads (``start_load_kv``) run on a background thread while the engine keeps stepping:
blocks are fetched in chunks from the nodes named by the lookup, straight into host
staging buffers, checksum-verified by the client, and copied whole into their vLLM
blocks; the next chunk's fetch overlaps the current chunk's copy.  A request is
reported finished (``get_finished``) when all of its blocks are in or failed; failed
blocks are reported in the same step by ``get_block_ids_with_load_errors`` and vLLM
recomputes them.  A block is never reported loaded unless its verified bytes were
written.

Saves (``wait_for_save``) are queued after the forward pass and never wait on the
network: a background thread copies the new full blocks into staging buffers (one
memcpy per layer and block) and hands them to the client's asynchronous put; the
buffers are recycled when the put completes.  vLLM keeps a finished request's blocks
until their copy-out is done and, on the same-host path, the node holds their commit
(it then stores them even if the engine dies right after): ``request_finished``
returned True, ``get_finished`` reports the request as sent.  ``handle_preemptions``
waits the same way for preempted requests before their blocks can be reused.  When
staging memory is full or the cluster is failing, saves are dropped (counted), never
waited for.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pegaflow import telemetry
from pegaflow.wire import LocatedBlocks

from .blockio import KVBlockIO
from .costmodel import LOCAL
from .discovery import LocalNodeFinder
from .localpath import LoadRequest, LocalPath, PendingLoad
from .metadata import LoadJob, SaveJob, StepPlan, WorkerReport
from .metrics import Counters
from .scheduler import LOCATE_PIN_S, WARM_UP_WAIT_S, CircuitBreaker
from .settings import ConnectorSettings

logger = logging.getLogger("pegaflow.connector")

_Buf = tuple[torch.Tensor, Any]
_LOAD_DEPTH = 3
"""chunks of one load in flight at once"""
_BREAKER_OPEN = "saves are failing, so they are paused for a while (circuit breaker)"


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


class Staging:
    """A bounded pool of reusable host buffers of ``chunk_blocks`` blocks each."""

    def __init__(
        self, io: KVBlockIO, chunk_blocks: int, max_bytes: int, min_chunks: int = 1
    ) -> None:
        self.io = io
        self.chunk_blocks = chunk_blocks
        self.max_chunks = max(min_chunks, max_bytes // max(1, chunk_blocks * io.block_bytes))
        self.max_bytes = self.max_chunks * chunk_blocks * io.block_bytes
        self._free: list[_Buf] = []
        self._held: list[tuple[_Buf, Callable[[], bool]]] = []
        self._made = 0
        self._cond = threading.Condition()

    def prefill(self, n: int) -> None:
        """Allocate ``n`` buffers now and touch their pages (no page faults on the hot path)."""
        bufs = []
        for _ in range(min(n, self.max_chunks)):
            buf = self.acquire(wait=False)
            if buf is None:
                break
            buf[0].zero_()
            bufs.append(buf)
        for buf in bufs:
            self.release(buf)

    def acquire(self, wait: bool, timeout: float = 0.0) -> _Buf | None:
        """A buffer; ``None`` when none is free (after ``timeout`` if ``wait``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._reclaim()
                if self._free:
                    return self._free.pop()
                if self._made < self.max_chunks:
                    self._made += 1
                    break
                left = deadline - time.monotonic()
                if not wait or left <= 0:
                    return None
                self._cond.wait(left)
        try:
            return self.io.new_staging(self.chunk_blocks)
        except Exception:
            with self._cond:
                self._made -= 1
            raise

    def release(self, buf: _Buf, ready: Callable[[], bool] | None = None) -> None:
        """Return a buffer to the pool; with ``ready``, only once ``ready()`` says nothing
        can write it any more (a failed get's receives may still land in it, after its
        blocks were checked: such a buffer is never handed out before)."""
        with self._cond:
            if ready is not None and not ready():
                self._held.append((buf, ready))
                return
            self._free.append(buf)
            self._cond.notify()

    def _reclaim(self) -> None:
        if self._held:
            ready = [h for h in self._held if h[1]()]
            self._held = [h for h in self._held if h not in ready]
            self._free.extend(b for b, _ in ready)


class StepTimer:
    """Times forward passes for the cost model: on the host clock for a CPU device (the
    forward runs while the host waits); with CUDA events on a GPU (the host only issues
    the kernels), read once the GPU has passed them."""

    def __init__(self) -> None:
        self._open: tuple[int, Any, float] | None = None
        self._pending: deque[tuple[int, Any, Any]] = deque()

    def begin(self, tokens: int, device: torch.device | None) -> None:
        """A forward pass of ``tokens`` scheduled tokens starts (0: do not time it)."""
        self._open = None
        if tokens <= 0:
            return
        if device is not None and device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open = (tokens, ev, 0.0)
        else:
            self._open = (tokens, None, time.perf_counter())

    def end(self) -> list[tuple[int, float]]:
        """The forward pass was issued; returns the ``(tokens, seconds)`` of every timed
        pass that has completed since the last call."""
        out: list[tuple[int, float]] = []
        if self._open is not None:
            tokens, ev, t0 = self._open
            self._open = None
            if ev is None:
                out.append((tokens, time.perf_counter() - t0))
            else:
                done = torch.cuda.Event(enable_timing=True)
                done.record()
                self._pending.append((tokens, ev, done))
                while len(self._pending) > 8:
                    self._pending.popleft()
        while self._pending and self._pending[0][2].query():
            tokens, ev, done = self._pending.popleft()
            out.append((tokens, ev.elapsed_time(done) / 1e3))
        return out


def _timing_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


def _ms(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def _chunks(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


class WorkerSide:
    """The worker-side engine of :class:`~pegaflow.connector.PegaKVConnector`.

    Args:
        settings: connector settings.
        shard: this worker's shard (its rank within the engine).
        counters: the counters to update.
        client_factory: builds the cluster client (lazily, on first transfer).
        retry_failed_loads: retry blocks that failed once more before reporting them
            (used with ``kv_load_failure_policy="fail"``, where a report fails requests).
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        shard: int,
        counters: Counters,
        client_factory: Callable[[], Any],
        retry_failed_loads: bool = False,
    ) -> None:
        self.settings = settings
        self.shard = shard
        self.counters = counters
        self._client_factory = client_factory
        self._client: Any = None
        self._client_failed_at = -1e9
        self._client_lock = threading.Lock()
        self.finder = LocalNodeFinder(settings.local_node, settings.rpc_timeout_s)
        """the storage node on this host (``local_node``, else found at start)"""
        self._local_ready = threading.Event()
        """set once the first search for the node on this host and the mapping of its
        pool (when it has one) are done"""
        self._retry = retry_failed_loads
        self.io: KVBlockIO | None = None
        self._local: LocalPath | None = None
        self._load_staging: Staging | None = None
        self._save_staging: Staging | None = None
        self._load_pool = concurrent.futures.ThreadPoolExecutor(1, "pegaflow-load")
        self._save_pool = concurrent.futures.ThreadPoolExecutor(1, "pegaflow-save")
        self._probe_pool = concurrent.futures.ThreadPoolExecutor(1, "pegaflow-probe")
        self._step = StepTimer()
        """times forward passes for the cost model"""
        self._fwd_timing: tuple[Any, Any] | None = None
        """device timing of a step with layer-wise loads (debug log only)"""
        self._queued_saves = 0
        """blocks of save jobs queued or being copied out, not yet sent"""
        self._inflight_saves = 0
        """blocks handed to puts (or same-host commits) not yet answered"""
        self._moved = 0
        """blocks of the running save job already sent (the save thread's own count)"""
        self._last_drop_log = -1e9
        self._lock = threading.Condition()
        self._loading: dict[str, int] = {}
        self._done_loads: dict[str, tuple[list[int], int | None]] = {}
        self._pending_gathers: dict[str, int] = {}
        self._delay_free: set[str] = set()
        self._load_errors: set[int] = set()
        self._sync_loads: list[tuple[LoadJob, Any, float]] = []
        self._report = WorkerReport()
        self._sampled: set[str] = set()
        """sources measured once already (see _sample)"""
        self.save_breaker = CircuitBreaker(
            settings.failures_to_backoff, settings.backoff_s, settings.backoff_max_s
        )
        self._save_failing = False
        """whether the last save failed (its reason was logged once)"""
        self._closed = False
        self._idle = False

    # ---- setup ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Adopt vLLM's KV cache tensors; on an unsupported layout the connector goes inert."""
        try:
            io = KVBlockIO(kv_caches, num_blocks, warm_up=False)
        except Exception as e:
            logger.error("PegaFlow: cannot use this KV cache layout (%s); connector inert", e)
            self._local_ready.set()
            return
        chunk_blocks = max(1, self.settings.chunk_bytes // io.block_bytes)
        half = self.settings.max_staging_bytes // 2
        self._load_staging = Staging(io, chunk_blocks, half, min_chunks=_LOAD_DEPTH)
        self._save_staging = Staging(io, chunk_blocks, half, min_chunks=1)
        if self.settings.can_load:
            self._load_staging.prefill(_LOAD_DEPTH)
        if self.settings.can_save:
            self._save_staging.prefill(1)
        self.io = io
        self._load_pool.submit(self._warm_up)  # kernel compiles off the engine's start path
        if self.settings.local_node and self.settings.same_host_shortcut:
            self._local = self._local_path(self.settings.local_node)
        if self.settings.mode != "off":
            # find the node on this host, map and pin its pool, off the engine's start path
            self._load_pool.submit(self._discover)
        else:
            self._local_ready.set()
        logger.info(
            "PegaFlow worker shard %d: %s; %d blocks per transfer chunk",
            self.shard,
            io.describe(),
            chunk_blocks,
        )

    def _get_client(self) -> Any:
        if self._client is not None:
            return self._client
        with self._client_lock:
            if self._client is None:
                if self._closed or (
                    time.monotonic() - self._client_failed_at < self.settings.backoff_s
                ):
                    return None
                try:
                    self._client = self._client_factory()
                except Exception as e:
                    self._client_failed_at = time.monotonic()
                    logger.warning("PegaFlow: cannot create the cluster client: %s", e)
                    return None
            return self._client

    @property
    def local_node(self) -> str:
        """The node on this host ('' while none is known)."""
        return self.finder.node

    def _wait_local(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for the engine-start search for the node on this host."""
        if not self._local_ready.is_set():
            self._local_ready.wait(timeout)

    # ---- per step ------------------------------------------------------------------

    def start_step(self, plan: StepPlan, idle: bool = False) -> None:
        """Start this step's loads (background) and note its delayed frees.

        ``idle``: the step runs no forward pass (vLLM only polls for transfers).
        """
        self._idle = idle
        if self._local_ready.is_set() and not self.finder.node:
            self.finder.maybe_retry(self._discover)
        for job in plan.loads:
            if job.probe:
                self._probe_pool.submit(self._run_probe, plan.namespace, job)
        async_loads = [j for j in plan.loads if not j.sync and not j.probe]
        with self._lock:
            self._delay_free.update(plan.delay_free)
            for job in async_loads:
                self._loading[job.req_id] = self._loading.get(job.req_id, 0) + 1
        for job in async_loads:
            self._load_pool.submit(self._run_load_safe, plan.namespace, job)
        sync = [j for j in plan.loads if j.sync]
        if sync:
            self._start_sync_loads(plan.namespace, sync)

    def begin_forward(self, plan: StepPlan) -> None:
        """The step's forward pass starts now (vLLM bound its metadata): time it."""
        sync = any(j.sync for j in plan.loads)  # its forward waits on loads: not compute
        self._step.begin(0 if sync else plan.tokens, self.io.device if self.io else None)
        self._fwd_timing = None
        on_gpu = self.io is not None and self.io.device.type == "cuda"
        if sync and on_gpu and logger.isEnabledFor(logging.DEBUG):
            self._fwd_timing = (_timing_event(), _timing_event())
            self._fwd_timing[0].record()

    def end_forward(self) -> None:
        """The step's forward pass was issued (``wait_for_save``)."""
        if self._fwd_timing is not None:
            self._fwd_timing[1].record()
        for tokens, seconds in self._step.end():
            self._sample("compute", tokens, seconds)

    def _forward_ms(self) -> float | None:
        """The device time of this step's forward pass (bound to issued, waits on its
        loads included), for the debug log of layer-wise loads; waits for it."""
        t = self._fwd_timing
        if t is None:
            return None
        t[1].synchronize()
        return float(t[0].elapsed_time(t[1]))

    def _sample(self, source: str, size: float, seconds: float) -> None:
        """A measurement for the scheduler's cost model (sent with the next report); the
        first of each source is dropped: it paid one-off set-up (see costmodel)."""
        with self._lock:
            if source not in self._sampled:
                self._sampled.add(source)
                return
            if len(self._report.samples) < 256:
                self._report.samples.append((source, int(size), float(seconds)))

    # ---- layer-wise (synchronous) loads ----------------------------------------------

    def _start_sync_loads(self, ns: str, jobs: list[LoadJob]) -> None:
        """Queue the copies of the loads that this step's forward pass waits for, layer
        by layer (:meth:`wait_layer`), all of them at once so that their copies go
        layer-major (:meth:`LocalPath.start_loads`); verified and reported by
        :meth:`finish_sync_loads`."""
        t0 = time.monotonic()
        self._wait_local(WARM_UP_WAIT_S)  # a request right after engine start
        local, client = self._local, self._get_client()
        here: list[LoadJob] = []
        if local is not None and client is not None and self.io is not None and ns:
            here = [
                j
                for j in jobs
                if all(self._node_of(j, i) == local.node_id for i in range(len(j.block_ids)))
            ]
            if here and not local.attach(client):
                here = []
        if here:
            assert local is not None
            reqs = []
            for job in here:
                located = self._located(job)
                gens = [self._gen_of(job, i) for i in range(len(job.block_ids))]
                reqs.append(LoadRequest(job.hashes, self.shard, job.block_ids, gens, located))
            try:
                got: list[PendingLoad | Exception] = local.start_loads(client, ns, reqs)
            except Exception as e:
                got = [e] * len(here)
            queued = time.monotonic() - t0
            for job, req, pending in zip(here, reqs, got, strict=True):
                if isinstance(pending, Exception):
                    logger.warning(
                        "PegaFlow: layer-wise load of %s failed: %s", job.req_id, pending
                    )
                    self._sync_loads.append((job, [False] * len(job.block_ids), t0))
                    continue
                self._sync_loads.append((job, pending, t0))
                self.counters.add("located_load_jobs", req.located is not None)
                pending.queued_s = queued
                pending.located_here = req.located is None
            self.counters.add("layerwise_start_seconds", queued)
        taken = {id(j) for j in here}
        for job in jobs:
            if id(job) in taken:
                continue
            # no local pool here after all: load now, whole, before the forward runs
            ok = [False] * len(job.block_ids)
            try:
                self._run_load(ns, job, ok)
            except Exception:
                logger.exception("PegaFlow: load of %s failed", job.req_id)
            self._sync_loads.append((job, ok, t0))

    def _located(self, job: LoadJob) -> tuple[list[int], LocatedBlocks] | None:
        """The scheduler's locations of this shard's blocks, if they are still pinned
        for long enough (else None: the worker locates them itself)."""
        where = job.located[self.shard] if self.shard < len(job.located) else None
        if where is None or len(where) != len(job.block_ids) or self.shard >= len(job.pins):
            return None
        if time.monotonic() - job.located_at > LOCATE_PIN_S / 2:
            return None  # pins about to lapse; they expire on the node
        return [job.pins[self.shard]], where

    def wait_layer(self, layer_name: str) -> None:
        """Make the forward pass (its CUDA stream) wait until ``layer_name``'s blocks
        of this step's layer-wise loads are in; never blocks the CPU."""
        if not self._sync_loads or self.io is None:
            return
        idx = self.io.layer_of.get(layer_name)
        for _job, pending, _t0 in self._sync_loads:
            if isinstance(pending, list):
                continue
            if idx is None:
                pending.transfer.wait_all()
            else:
                pending.transfer.wait_layer(idx)

    def finish_sync_loads(self) -> None:
        """Verify and account this step's layer-wise loads; failed blocks are reported
        by the next :meth:`take_load_errors` (vLLM then recomputes them)."""
        loads, self._sync_loads = self._sync_loads, []
        for job, pending, t0 in loads:
            if isinstance(pending, list):
                ok = pending
            else:
                try:
                    t1 = time.monotonic()
                    ok = pending.finish()
                    t2 = time.monotonic()
                    self.counters.add("layerwise_wait_seconds", t2 - t1)
                    self.counters.add("local_load_blocks", sum(ok))
                    if self.io is not None and any(ok):  # what the load added to the step
                        self._sample(
                            LOCAL, sum(ok) * self.io.block_bytes, pending.queued_s + (t2 - t1)
                        )
                    if logger.isEnabledFor(logging.DEBUG):
                        logger.debug(
                            "PegaFlow: layer-wise load of %s: %d of %d blocks, located %s, "
                            "queued in %.2f ms, forward pass %.2f ms, then waited %.2f ms; "
                            "on the device: the step's copies %s ms, its forward %s ms",
                            job.req_id, sum(ok), len(ok),
                            "here" if pending.located_here else "by the scheduler",
                            pending.queued_s * 1e3, (t1 - t0 - pending.queued_s) * 1e3,
                            (t2 - t1) * 1e3, _ms(pending.transfer.device_ms()),
                            _ms(self._forward_ms()),
                        )  # fmt: skip
                except Exception as e:
                    logger.warning("PegaFlow: layer-wise load of %s failed: %s", job.req_id, e)
                    ok = [False] * len(job.block_ids)
            failed, first = self._account_load(job, ok, t0)
            self.counters.add("layerwise_load_jobs")
            with self._lock:
                self._load_errors.update(failed)
                if first is not None:
                    prev = self._report.load_failed.get(job.req_id, first)
                    self._report.load_failed[job.req_id] = min(prev, first)

    def submit_saves(self, plan: StepPlan) -> None:
        """Queue the copy-out of this step's newly full blocks (returns at once)."""
        if not plan.saves:
            return
        if self.io is None or not self.settings.can_save or not plan.namespace:
            self._drop(plan.saves, "the connector is inert (see the error logged at start)")
            return
        if not self.save_breaker.allow():
            self._drop(plan.saves, _BREAKER_OPEN)
            return
        marker = self.io.record_step()
        with self._lock:
            for job in plan.saves:
                self._pending_gathers[job.req_id] = self._pending_gathers.get(job.req_id, 0) + 1
                self._queued_saves += len(job.hashes)
        for job in plan.saves:
            self._save_pool.submit(self._run_save_safe, plan.namespace, job, marker)

    def wait_for_copies(self, req_ids: Sequence[str], timeout: float = 120.0) -> None:
        """Block until no copy-out of ``req_ids`` is pending (their blocks may be reused)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while any(self._pending_gathers.get(r, 0) for r in req_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.error("PegaFlow: copy-out of preempted requests still pending")
                    return
                self._lock.wait(left)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose blocks may now be freed, requests whose loads are done).

        In a step without a forward pass that only waits for loads, wait briefly for one
        to land instead of returning at once: vLLM would otherwise spin through empty
        steps, taking the CPU the transfer needs (2-core hosts) for nothing.
        """
        self.finish_sync_loads()
        with self._lock:
            if self._idle and self._loading and not self._done_loads:
                self._lock.wait_for(lambda: bool(self._done_loads), self.settings.idle_wait_s)
            sending = {r for r in self._delay_free if not self._pending_gathers.get(r, 0)}
            self._delay_free -= sending
            if sending:
                logger.debug("PegaFlow: saves done, blocks reusable: %s", sorted(sending))
            recving = set(self._done_loads)
            for rid, (failed, first) in self._done_loads.items():
                self._load_errors.update(failed)
                if first is not None:
                    self._report.load_failed[rid] = first
            self._done_loads.clear()
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed, reported once (vLLM recomputes them)."""
        self.finish_sync_loads()
        with self._lock:
            errs, self._load_errors = self._load_errors, set()
        return errs

    def take_report(self) -> WorkerReport | None:
        """Outcomes the scheduler should learn from (None when there are none)."""
        with self._lock:
            rep, self._report = self._report, WorkerReport()
        if rep.samples and self.io is not None:
            rep.block_bytes = self.io.block_bytes
        return None if rep.is_empty() else rep

    def has_pending_loads(self) -> bool:
        """Whether any load is still running (tests)."""
        with self._lock:
            return bool(self._loading)

    # ---- loads ---------------------------------------------------------------------

    def _run_load_safe(self, ns: str, job: LoadJob) -> None:
        t0 = time.monotonic()
        n = len(job.block_ids)
        ok = [False] * n
        try:
            with telemetry.span(
                "pegaflow.connector.load",
                {"pegaflow.blocks": n} if telemetry.tracing else None,
                parent=telemetry.request_context(job.req_id),
            ):
                self._run_load(ns, job, ok)
        except Exception:
            logger.exception("PegaFlow: load of %s failed", job.req_id)
        failed, first = self._account_load(job, ok, t0)
        with self._lock:
            left = self._loading.get(job.req_id, 1) - 1
            if left > 0:
                self._loading[job.req_id] = left
            else:
                self._loading.pop(job.req_id, None)
            prev = self._done_loads.get(job.req_id)
            if prev is not None:
                failed = prev[0] + failed
                first = min(x for x in (prev[1], first) if x is not None) if failed else None
            self._done_loads[job.req_id] = (failed, first)
            self._lock.notify_all()

    def _account_load(
        self, job: LoadJob, ok: list[bool], t0: float
    ) -> tuple[list[int], int | None]:
        """Count a finished load; returns (failed block ids, first failed index)."""
        n = len(job.block_ids)
        failed = [job.block_ids[i] for i in range(n) if not ok[i]]
        first = next((job.first_block + i for i in range(n) if not ok[i]), None)
        loaded = n - len(failed)
        self.counters.add("load_jobs")
        self.counters.add("load_blocks", loaded)
        if self.io is not None:
            self.counters.add("load_bytes", loaded * self.io.block_bytes)
        self.counters.add("load_failed_blocks", len(failed))
        self.counters.add("load_seconds", time.monotonic() - t0)
        if failed:
            logger.warning(
                "PegaFlow: %d of %d blocks of %s could not be loaded; vLLM recomputes them",
                len(failed),
                n,
                job.req_id,
            )
        return failed, first

    def _run_load(self, ns: str, job: LoadJob, ok: list[bool]) -> None:
        io, staging = self.io, self._load_staging
        if io is None or staging is None or not ns or not job.block_ids:
            return
        client = self._get_client()
        if client is None:
            return
        timeout = self.settings.transfer_timeout_s
        done_local = self._load_local(client, ns, job, ok)
        if len(done_local) == len(job.block_ids):
            return
        t_remote = time.monotonic()
        try:
            self._run_remote(ns, job, ok, client, done_local, io, staging, timeout)
        finally:
            self._sample_remote(job, ok, done_local, time.monotonic() - t_remote)

    def _sample_remote(
        self, job: LoadJob, ok: list[bool], done_local: set[int], seconds: float
    ) -> None:
        """One measurement per node of a load's UCX part (its time split by bytes).  A
        node whose blocks all failed counts when it took long (a timeout is slow)."""
        if self.io is None:
            return
        loaded: dict[str, int] = {}
        tried: dict[str, int] = {}
        for i in range(len(job.block_ids)):
            node = self._node_of(job, i)
            if not node or i in done_local:
                continue
            tried[node] = tried.get(node, 0) + 1
            loaded[node] = loaded.get(node, 0) + ok[i]
        total = sum(tried.values())
        for node, n in tried.items():
            blocks = loaded[node] or (n if seconds >= 0.1 else 0)
            if blocks:
                self._sample(node, blocks * self.io.block_bytes, seconds * n / total)

    def _run_remote(
        self,
        ns: str,
        job: LoadJob,
        ok: list[bool],
        client: Any,
        done_local: set[int],
        io: KVBlockIO,
        staging: Staging,
        timeout: float,
    ) -> None:
        """The UCX part of a load: chunks fetched into staging, copied into the cache."""

        def fetch(rows: range, buf: _Buf, which: Sequence[int]) -> tuple[list[int], Any]:
            items: list[tuple[str, bytes, int, Any]] = []
            idx: list[int] = []
            for i in which:
                nodes = job.nodes[i] if i < len(job.nodes) else []
                node = nodes[self.shard] if self.shard < len(nodes) else ""
                if not node or i in done_local:
                    continue
                items.append((node, job.hashes[i], self.shard, buf[1][i - rows.start]))
                idx.append(i)
            if not items:
                return idx, None
            gens = [self._gen_of(job, i) for i in idx]
            fut = client.submit_get_blocks(
                ns,
                items,
                timeout=timeout,
                generations=gens if any(g is not None for g in gens) else None,
            )
            return idx, fut

        def outcome(idx: list[int], fut: Any) -> tuple[list[int], list[int]]:
            got: list[bool] = [False] * len(idx)
            if fut is not None:
                try:
                    got = [bool(g) for g in fut.result(timeout + 5.0)]
                except Exception as e:
                    logger.warning("PegaFlow: get of %d blocks failed: %s", len(idx), e)
            if len(got) != len(idx):
                got = [False] * len(idx)
            good = [i for i, g in zip(idx, got, strict=True) if g]
            bad = [i for i, g in zip(idx, got, strict=True) if not g]
            return good, bad

        def complete(rows: range, buf: _Buf, idx: list[int], fut: Any) -> None:
            good, bad = outcome(idx, fut)
            if bad and self._retry:
                idx2, fut2 = fetch(rows, buf, bad)
                good2, _ = outcome(idx2, fut2)
                good = sorted(good + good2)
            if good:
                t0 = time.monotonic()
                io.scatter([job.block_ids[i] for i in good], buf[0], [i - rows.start for i in good])
                self.counters.add("copy_seconds", time.monotonic() - t0)
                for i in good:
                    ok[i] = True

        def settled(buf: _Buf) -> Callable[[], bool]:
            return lambda: bool(client.settled(buf[1]))

        pending: deque[tuple[range, _Buf, list[int], Any]] = deque()
        try:
            for rows in _chunks(len(job.block_ids), staging.chunk_blocks):
                buf = staging.acquire(wait=True, timeout=timeout)
                if buf is None:
                    logger.warning("PegaFlow: no staging memory for a load; blocks fail")
                    break
                idx, fut = fetch(rows, buf, rows)
                pending.append((rows, buf, idx, fut))
                if len(pending) >= _LOAD_DEPTH:  # later chunks in flight while one lands
                    r, b, i, f = pending.popleft()
                    try:
                        complete(r, b, i, f)
                    finally:
                        staging.release(b, settled(b))
            while pending:
                r, b, i, f = pending.popleft()
                try:
                    complete(r, b, i, f)
                finally:
                    staging.release(b, settled(b))
        finally:
            for _r, b, _i, f in pending:  # after an error: let in-flight gets land first
                if f is not None:
                    try:
                        f.result(timeout + 5.0)
                    except Exception:
                        pass
                staging.release(b, settled(b))

    def _run_probe(self, ns: str, job: LoadJob) -> None:
        """Fetch a probe's blocks into staging memory (never into the KV cache), chunk by
        chunk, and report the time: the cost model's measurement of a declined node."""
        staging, client = self._load_staging, self._get_client()
        if staging is None or client is None or self.io is None or not ns or self._closed:
            return
        buf = staging.acquire(wait=False)
        if buf is None:
            return  # loads need the staging memory more
        nodes: dict[str, int] = {}
        loaded = 0
        t0 = time.monotonic()
        try:
            for rows in _chunks(len(job.hashes), staging.chunk_blocks):
                items = []
                for j, i in enumerate(rows):
                    node = self._node_of(job, i)
                    if node:
                        nodes[node] = nodes.get(node, 0) + 1
                        items.append((node, job.hashes[i], self.shard, buf[1][j]))
                if items:
                    got = client.get_blocks(ns, items, timeout=self.settings.transfer_timeout_s)
                    loaded += sum(bool(g) for g in got)
        except Exception as e:
            logger.debug("PegaFlow: probe of %s failed: %s", job.req_id, e)
        finally:
            staging.release(buf)
        seconds = time.monotonic() - t0
        if len(nodes) == 1 and (loaded or seconds >= 0.1):
            node = next(iter(nodes))
            nbytes = (loaded or nodes[node]) * self.io.block_bytes
            self._sample(node, nbytes, seconds)
            self.counters.add("probe_bytes", loaded * self.io.block_bytes)

    def _warm_up(self) -> None:
        try:
            if self.io is not None:
                self.io.warm_up()
        except Exception as e:  # the first copy then compiles it
            logger.warning("PegaFlow: tile kernel warm-up failed: %s", e)

    def _local_path(self, node: str) -> LocalPath:
        assert self.io is not None
        s = self.settings
        return LocalPath(self.io, node, s.transfer_timeout_s, s.verify_threads)

    def _discover(self) -> None:
        """Find the node on this host (unless ``local_node`` names it) and, with the
        same-host shortcut, map its pool (engine start, then retries while none is found)."""
        try:
            client = self._get_client()
            if client is None or self.io is None:
                return
            node = self.finder.find(client)
            if node and self.settings.same_host_shortcut and self._local is None:
                local = self._local_path(node)
                local.attach(client)
                self._local = local
            elif self._local is not None:
                self._local.attach(client)
        finally:
            self._local_ready.set()

    def _gen_of(self, job: LoadJob, i: int) -> int | None:
        gens = job.gens[i] if i < len(job.gens) else []
        return gens[self.shard] if self.shard < len(gens) else None

    def _node_of(self, job: LoadJob, i: int) -> str:
        nodes = job.nodes[i] if i < len(job.nodes) else []
        return nodes[self.shard] if self.shard < len(nodes) else ""

    def _load_local(self, client: Any, ns: str, job: LoadJob, ok: list[bool]) -> set[int]:
        """Load the blocks held by this host's node through its pool file; returns the
        indexes it handled (loaded or failed), which the UCX path then skips."""
        local = self._local
        if local is None:
            return set()
        idx = [i for i in range(len(job.block_ids)) if self._node_of(job, i) == local.node_id]
        if not idx or not local.attach(client):
            return set()
        t0 = time.monotonic()
        try:
            pending = local.start_load(
                client,
                ns,
                [job.hashes[i] for i in idx],
                self.shard,
                [job.block_ids[i] for i in idx],
            )
            for i, good in zip(idx, pending.finish(), strict=True):
                ok[i] = good
            loaded = sum(ok[i] for i in idx)
            self.counters.add("local_load_blocks", loaded)
            if loaded and self.io is not None:
                self._sample(LOCAL, loaded * self.io.block_bytes, time.monotonic() - t0)
        except Exception as e:
            logger.warning("PegaFlow: local load of %d blocks failed: %s", len(idx), e)
        self.counters.add("copy_seconds", time.monotonic() - t0)
        return set(idx)

    # ---- saves ---------------------------------------------------------------------

    def _drop(self, jobs: Sequence[SaveJob], why: str) -> None:
        """Count blocks not saved, and say why (a warning at most every 10 s)."""
        n = sum(len(j.hashes) for j in jobs)
        with self._lock:
            for job in jobs:
                self._report.save_failed.extend(job.hashes)
        self.counters.add("save_dropped_blocks", n)
        now = time.monotonic()
        if n and now - self._last_drop_log >= 10.0:
            self._last_drop_log = now
            logger.warning(
                "PegaFlow: %d blocks not saved: %s (counted as save_dropped_blocks; "
                "requests that need them later compute them)",
                n,
                why,
            )

    def _sent(self, n: int) -> None:
        """``n`` blocks of the running save job went from queued to in flight."""
        with self._lock:
            self._queued_saves -= n
            self._inflight_saves += n
            self._moved += n

    def _run_save_safe(self, ns: str, job: SaveJob, marker: Any) -> None:
        # the job's blocks count as queued until each chunk is sent (then in flight) or
        # the job ends: a save being copied out is never uncounted (shutdown's books)
        with self._lock:
            self._moved = 0
        try:
            with telemetry.span(
                "pegaflow.connector.save", parent=telemetry.request_context(job.req_id)
            ):
                self._run_save(ns, job, marker)
        except Exception:
            if self._closed:  # the bounded wait at shutdown is over: dropped, counted
                logger.debug("PegaFlow: save of %s cut short by shutdown", job.req_id)
            else:
                logger.exception("PegaFlow: save of %s failed", job.req_id)
        finally:
            with self._lock:
                self._queued_saves -= len(job.hashes) - self._moved
                self._gathered(job.req_id)

    def _gathered(self, req_id: str) -> None:
        """One hold on ``req_id``'s blocks is over (a save job, or a same-host commit the
        node did not hold yet); at none, vLLM may reuse them.  Called with the lock."""
        left = self._pending_gathers.get(req_id, 1) - 1
        if left > 0:
            self._pending_gathers[req_id] = left
        else:
            self._pending_gathers.pop(req_id, None)
        self._lock.notify_all()

    def _hold_until_taken(self, req_id: str) -> Callable[[], None]:
        """Hold ``req_id``'s blocks from reuse until the callback returned is called (the
        node holds their commit: they are stored even if this process dies now); calls
        after the first do nothing."""
        done = False

        def release() -> None:
            nonlocal done
            with self._lock:
                if not done:
                    done = True
                    self._gathered(req_id)

        with self._lock:
            self._pending_gathers[req_id] = self._pending_gathers.get(req_id, 0) + 1
        return release

    def _run_save(self, ns: str, job: SaveJob, marker: Any) -> None:
        io, staging = self.io, self._save_staging
        assert io is not None and staging is not None
        self._wait_local(self.settings.rpc_timeout_s)  # saves right after engine start
        client = self._get_client()
        if client is not None and self._local is not None and self._local.attach(client):
            self._save_local(client, ns, job, marker)
            return
        rows_all = _chunks(len(job.block_ids), staging.chunk_blocks)
        for rows in rows_all:
            hashes = job.hashes[rows.start : rows.stop]
            if client is None or not self.save_breaker.allow():
                rest = job.hashes[rows.start :]
                why = "no connection to the cluster" if client is None else _BREAKER_OPEN
                self._drop([SaveJob(job.req_id, [], rest)], why)
                return
            buf = staging.acquire(wait=False)
            if buf is None:
                self._drop(
                    [SaveJob(job.req_id, [], hashes)],
                    f"the save staging memory is full ({_size(staging.max_bytes)}, half of "
                    "max_staging_bytes): blocks come faster than the cluster stores them; "
                    "raise max_staging_bytes, or run a node on this host",
                )
                continue
            try:
                t0 = time.monotonic()
                io.gather(job.block_ids[rows.start : rows.stop], buf[0], after=marker)
                self.counters.add("copy_seconds", time.monotonic() - t0)
                items = [(h, self.shard, buf[1][j]) for j, h in enumerate(hashes)]
                fut = client.submit_put_blocks(
                    ns,
                    items,
                    node_id=self.local_node or None,
                    timeout=self.settings.transfer_timeout_s,
                )
            except Exception as e:
                staging.release(buf)
                self._drop([SaveJob(job.req_id, [], hashes)], f"{type(e).__name__}: {e}")
                raise
            started = time.monotonic()
            self._sent(len(hashes))
            fut.add_done_callback(
                lambda f, buf=buf, hashes=hashes, started=started: self._put_done(
                    f, buf, hashes, started
                )
            )

    def _save_local(self, client: Any, ns: str, job: SaveJob, marker: Any) -> None:
        local = self._local
        assert local is not None and self.io is not None
        chunk = max(1, self.settings.chunk_bytes // self.io.block_bytes) * 4
        for rows in _chunks(len(job.block_ids), chunk):
            hashes = job.hashes[rows.start : rows.stop]
            if not self.save_breaker.allow():
                self._drop([SaveJob(job.req_id, [], job.hashes[rows.start :])], _BREAKER_OPEN)
                return
            t0 = time.monotonic()
            taken = self._hold_until_taken(job.req_id)
            try:
                fut = local.save(
                    client, ns, hashes, self.shard, job.block_ids[rows.start : rows.stop],
                    marker, taken,
                )  # fmt: skip
            except Exception as e:
                fut = concurrent.futures.Future()
                fut.set_exception(e)
            self.counters.add("copy_seconds", time.monotonic() - t0)
            self._sent(len(hashes))
            fut.add_done_callback(
                lambda f, hashes=hashes, t0=t0, taken=taken: self._local_commit_done(
                    f, hashes, t0, taken
                )
            )

    def _local_commit_done(
        self,
        fut: concurrent.futures.Future[Any],
        hashes: list[bytes],
        started: float,
        taken: Callable[[], None],
    ) -> None:
        try:
            self._record_put(fut, hashes, started)
        finally:
            taken()  # the commit failed, or the node never said it held it
            self._put_answered(len(hashes))

    def _put_done(
        self, fut: concurrent.futures.Future[Any], buf: _Buf, hashes: list[bytes], started: float
    ) -> None:
        assert self._save_staging is not None
        self._save_staging.release(buf)
        try:
            self._record_put(fut, hashes, started)
        finally:
            self._put_answered(len(hashes))

    def _put_answered(self, n: int) -> None:
        with self._lock:
            self._inflight_saves -= n
            self._lock.notify_all()

    def _record_put(
        self, fut: concurrent.futures.Future[Any], hashes: list[bytes], started: float
    ) -> None:
        assert self.io is not None
        if self._closed:
            return  # answered after the bounded wait at shutdown: counted as dropped
        self.counters.add("save_seconds", time.monotonic() - started)
        try:
            res = fut.result()
        except Exception as e:
            if self.save_breaker.failure():
                logger.warning("PegaFlow: saves failing (%r); pausing them", e)
            elif not self._save_failing:
                logger.warning(
                    "PegaFlow: a save of %d blocks failed (%r); they are recomputed when needed",
                    len(hashes),
                    e,
                )
            self._save_failing = True
            with self._lock:
                self._report.save_failed.extend(hashes)
            self.counters.add("save_failed_blocks", len(hashes))
            return
        self.save_breaker.success()
        self._save_failing = False
        stored = int(getattr(res, "stored", 0))
        present = int(getattr(res, "skipped", 0))
        failed = int(getattr(res, "failed", 0))
        self.counters.add("save_blocks", stored)
        self.counters.add("save_present_blocks", present)
        self.counters.add("save_bytes", stored * self.io.block_bytes)
        if failed:
            self.counters.add("save_failed_blocks", failed)
            with self._lock:
                self._report.save_failed.extend(hashes)

    # ---- teardown ------------------------------------------------------------------

    def pending_saves(self) -> int:
        """Blocks of saves queued or in flight (not yet answered by a node)."""
        with self._lock:
            return self._queued_saves + self._inflight_saves

    def shutdown(self, wait_s: float | None = None) -> None:
        """Let pending saves finish, up to ``wait_s`` (default ``shutdown_wait_s``) in
        all; count and log (a warning) those still pending then; close the client."""
        if self._closed:
            return
        wait_s = self.settings.shutdown_wait_s if wait_s is None else wait_s
        t0 = time.monotonic()
        deadline = t0 + wait_s
        pending = self.pending_saves()
        if pending:
            logger.info(
                "PegaFlow: engine shutdown: waiting up to %.1f s for %d blocks of saves",
                wait_s,
                pending,
            )
        self._load_pool.shutdown(wait=True, cancel_futures=True)  # no load is wanted now
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        try:  # the save thread runs its jobs in order: this runs once they all ran
            self._save_pool.submit(lambda: None).result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            pass
        self._save_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            while self._inflight_saves and time.monotonic() < deadline:
                self._lock.wait(max(0.0, deadline - time.monotonic()))
            queued, inflight = self._queued_saves, self._inflight_saves
            self._closed = True  # answers that come later are not counted again
        waited = time.monotonic() - t0
        if pending:
            self.counters.add("save_shutdown_seconds", waited)
        if queued + inflight:
            self.counters.add("save_dropped_blocks", queued + inflight)
            logger.warning(
                "PegaFlow: engine shutdown: %d blocks of saves did not finish within "
                "shutdown_wait_s=%.1f s (%d still queued for copy-out, %d sent and not "
                "answered) and are lost; a later engine computes them again. Raise "
                "shutdown_wait_s to wait longer.",
                queued + inflight, wait_s, queued, inflight,
            )  # fmt: skip
        elif pending:
            logger.info(
                "PegaFlow: engine shutdown: pending saves finished in %.0f ms", waited * 1e3
            )
        self.counters.maybe_write(force=True)
        if self._local is not None:
            self._local.close()
        c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception:
                pass
