"""Worker side of the connector: async loads into the KV cache, async saves out of it.

Runs in every vLLM worker (one per TP/PP rank); each rank moves only its own shard.
:class:`WorkerSide` routes each job through the storage media
(:mod:`~pegaflow.connector.media.base`): the pool file of the node on this host
(:mod:`~pegaflow.connector.media.poolfile`) for the blocks it holds, UCX through host staging
(:mod:`~pegaflow.connector.media.remote`) for the rest; it keeps the books (:mod:`.books`).

Loads (``start_load_kv``) run on a background thread while the engine keeps stepping.
A request is reported finished (``get_finished``) when all of its blocks are in or
failed; failed blocks are reported in the same step by
``get_block_ids_with_load_errors`` and vLLM recomputes them.  A block is never reported
loaded unless its verified bytes were written.  Layer-wise loads (``LoadJob.sync``) are
queued before the forward pass, which waits for them layer by layer
(:mod:`~pegaflow.connector.media.layerwise`).

Saves (``wait_for_save``) are queued after the forward pass and never wait on the
network: a background thread copies the new full blocks out and hands them to a
medium.  vLLM keeps a finished request's blocks until their copy-out is done and, on
the same-host path, the node holds their commit (it then stores them even if the
engine dies right after): ``request_finished`` returned True, ``get_finished`` reports
the request as sent.  ``handle_preemptions`` waits the same way for preempted requests
before their blocks can be reused.  When staging memory is full or the cluster is
failing, saves are dropped (counted), never waited for.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from pegaflow.deadline import Deadline
from pegaflow.observability import telemetry

from .. import sameprocess
from ..discovery import LocalNodeFinder
from ..media.base import BREAKER_OPEN, LoadResult, Medium
from ..media.kvio import KVBlockIO
from ..media.layerwise import LayerwiseLoads
from ..media.localpath import LocalPath
from ..media.poolfile import PoolFileMedium, SyncLoad, save_chunk_blocks
from ..media.remote import RemoteMedium
from ..metadata import LoadJob, SaveJob, StepPlan, WorkerReport
from ..metrics import Counters
from ..settings import ConnectorSettings
from .books import WorkerBooks
from .steptimer import StepTimer

logger = logging.getLogger("pegaflow.connector")


class WorkerSide:
    """The worker-side engine of :class:`~pegaflow.connector.PegaKVConnector`.

    Args:
        settings: connector settings.
        shard: this worker's shard (:meth:`~pegaflow.connector.namespace.ShardLayout.shard`).
        counters: the counters to update.
        client_factory: builds the cluster client (lazily, on first transfer).
        retry_failed_loads: retry blocks that failed once more before reporting them
            (used with ``kv_load_failure_policy="fail"``, where a report fails requests).
        defer_checks: answer a step's load errors deferred (:mod:`~pegaflow.connector.loadcheck`).
        graph_tokens: vLLM captures CUDA graphs for steps of up to this many tokens (0:
            none, eager).  It captures them right after :meth:`register_kv_caches`,
            which then does the worker's start-up work itself (:meth:`_start_up`;
            :func:`~pegaflow.connector.compat.cuda_graph_tokens`).
        new_blocks_may_be_busy: a step still in flight on the GPU may touch the blocks
            vLLM gives to new requests (a vLLM that does not defer frees,
            :func:`~pegaflow.connector.compat.defers_block_frees`): loads then wait for the GPU work
            queued before them.
        saves: this worker stores its shard (False, MLA: another rank does, counts them).
        failed_as_requests: report a failed load by its request, not its block ids
            (several KV cache groups: vLLM cannot map block ids back to requests;
            :meth:`take_failed_requests`).
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        shard: int,
        counters: Counters,
        client_factory: Callable[[], Any],
        retry_failed_loads: bool = False,
        defer_checks: bool = False,
        graph_tokens: int = 0,
        new_blocks_may_be_busy: bool = True,
        saves: bool = True,
        failed_as_requests: bool = False,
    ) -> None:
        self.settings = settings
        self.failed_as_requests = failed_as_requests
        self._failed_requests: set[str] = set()
        self.shard = shard
        self.counters = counters
        self._client_factory = client_factory
        self._client: Any = None
        self._client_failed_at = -1e9
        self._client_lock = threading.Lock()
        self.finder = LocalNodeFinder(settings.local_node, settings.rpc_timeout_s)
        """the storage node on this host (``local_node``, else found at start)"""
        self.graph_tokens = graph_tokens
        self.new_blocks_may_be_busy = new_blocks_may_be_busy
        self._local_ready = threading.Event()
        """set once the first search for the node on this host and the mapping of its
        pool (when it has one) are done"""
        self._retry = retry_failed_loads
        self.saves = saves
        self.io: KVBlockIO | None = None
        self._remote: RemoteMedium | None = None
        """UCX through host staging (set once the KV cache is registered)"""
        self._pool: PoolFileMedium | None = None
        """the pool file of the node on this host (once known and mapped)"""
        self._load_pool = concurrent.futures.ThreadPoolExecutor(1, "pegaflow-load")
        self._save_pool = concurrent.futures.ThreadPoolExecutor(1, "pegaflow-save")
        self._probe_pool = concurrent.futures.ThreadPoolExecutor(1, "pegaflow-probe")
        self._step = StepTimer()
        """times forward passes for the cost model"""
        self.books = WorkerBooks(settings, counters)
        """the report, the save counts and holds, the save breaker (shared with the media)"""
        self._lock = self.books.lock
        self._loading: dict[str, int] = {}
        self._done_loads: dict[str, tuple[list[int], int | None]] = {}
        self._delay_free: set[str] = set()
        self._load_errors: set[int] = set()
        self._idle = False
        self.layerwise = LayerwiseLoads(self, defer_checks)
        """the steps' layer-wise (synchronous) loads"""

    # ---- setup ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Adopt vLLM's KV cache tensors; on an unsupported layout the connector goes inert."""
        try:
            io = KVBlockIO(kv_caches, num_blocks, warm_up=False)
        except Exception as e:
            logger.error("PegaFlow: cannot use this KV cache layout (%s); connector inert", e)
            self._local_ready.set()
            return
        self._remote = RemoteMedium(io, self.finder, self.shard, self.settings, self._retry)
        chunk_blocks = self._remote.load_staging.chunk_blocks
        self.books.block_bytes = io.block_bytes
        self.io = io
        if self.settings.local_node and self.settings.same_host_shortcut:
            self._pool = self._pool_file(self.settings.local_node)
        if self.settings.mode == "off":
            self._local_ready.set()
        self._start_up(at_once=bool(self.graph_tokens))
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
    def client(self) -> Any:
        """The cluster client, once made (None before): the scheduler of this process
        reads which nodes failed its loads from it (its ``health``)."""
        return self._client

    @property
    def local_node(self) -> str:
        """The node on this host ('' while none is known)."""
        return self.finder.node

    @property
    def _closed(self) -> bool:
        return self.books.closed

    @property
    def _report(self) -> WorkerReport:
        return self.books.report

    @property
    def _pending_gathers(self) -> dict[str, int]:
        return self.books.pending_gathers

    @property
    def _local(self) -> LocalPath | None:
        """The mapped pool of the node on this host, when the shortcut has one."""
        pool = self._pool
        return pool.path if pool is not None else None

    def _media(self) -> list[Medium]:
        """The media a job is routed through, in order: the pool file first."""
        return [m for m in (self._pool, self._remote) if m is not None]

    @property
    def pool(self) -> PoolFileMedium | None:
        """The pool-file medium of the node on this host (None while not mapped)."""
        return self._pool

    def pool_ready(self, timeout: float = 0.0) -> bool:
        """Whether the engine-start search for the node on this host is done, waiting
        up to ``timeout`` for it."""
        if not self._local_ready.is_set() and timeout > 0:
            self._local_ready.wait(timeout)
        return self._local_ready.is_set()

    def get_client(self) -> Any:
        """The cluster client, made on first use (None while it cannot be made)."""
        return self._get_client()

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
        if any(not j.probe for j in plan.loads):
            self.follow_steps()
        with self._lock:
            self._delay_free.update(plan.delay_free)
            for job in async_loads:
                self._loading[job.req_id] = self._loading.get(job.req_id, 0) + 1
        for job in async_loads:
            self._load_pool.submit(self._run_load_safe, plan.namespace, job)
        self.layerwise.start_step(plan)

    def begin_forward(self, plan: StepPlan) -> None:
        """The step's forward pass starts now (vLLM bound its metadata): time it."""
        sync = any(j.sync for j in plan.loads)  # its forward waits on loads: not compute
        self._step.begin(0 if sync else plan.tokens, self.io.device if self.io else None)
        self.layerwise.begin_forward(plan, sync)

    def end_forward(self) -> None:
        """The step's forward pass was issued (``wait_for_save``)."""
        self.layerwise.end_forward()
        for tokens, seconds in self._step.end():
            self.books.sample("compute", tokens, seconds)

    # ---- layer-wise (synchronous) loads: :mod:`pegaflow.connector.media.layerwise` ----

    def prestart(self, plan: StepPlan) -> None:
        """Queue a planned step's layer-wise loads early (:meth:`LayerwiseLoads.prestart`)."""
        self.layerwise.prestart(plan)

    def follow_steps(self) -> None:
        """Make the loads queued from now on wait for the GPU work queued so far, where
        a step in flight may still touch the blocks vLLM gives to new requests: vLLM
        releases a finished or preempted request's blocks once the last step that
        touched them is done (``defer_block_free``, with asynchronous scheduling and a
        KV consumer: every engine that loads), but not in every version
        (:func:`~pegaflow.connector.compat.defers_block_frees`)."""
        if self.new_blocks_may_be_busy and self.io is not None:
            self.io.follow(self.io.record_step())

    def prestart_job(self, job: LoadJob, ns: str) -> None:
        """Queue one request's layer-wise load as soon as vLLM allocated its blocks
        (:meth:`LayerwiseLoads.prestart_job`)."""
        self.layerwise.prestart_job(job, ns)

    def wait_layer(self, layer_name: str) -> None:
        """Make the forward pass (its CUDA stream) wait until ``layer_name``'s blocks
        of this step's layer-wise loads are in; never blocks the CPU."""
        self.layerwise.wait_layer(layer_name)

    def finish_sync_loads(self) -> None:
        """Verify and account the layer-wise loads queued so far; failed blocks are
        reported by the next :meth:`take_load_errors` (vLLM then recomputes them)."""
        failed = self.layerwise.finish()
        with self._lock:
            self._load_errors.update(failed)

    @property
    def defer_checks(self) -> bool:
        """Whether load errors are answered deferred (:mod:`~pegaflow.connector.loadcheck`): as
        built (``defer_checks``) until vLLM once does not read such an answer in time."""
        return self.layerwise.defer_checks

    @property
    def _sync_loads(self) -> list[tuple[LoadJob, Any, float]]:
        return self.layerwise.sync_loads

    @property
    def _early_loads(self) -> list[SyncLoad]:
        return self.layerwise.early

    def submit_saves(self, plan: StepPlan) -> None:
        """Queue the copy-out of this step's newly full blocks (returns at once)."""
        if not plan.saves or not self.saves:
            return
        if self.io is None or not self.settings.can_save or not plan.namespace:
            self.books.drop(plan.saves, "the connector is inert (see the error logged at start)")
            return
        if not self.books.allow():
            self.books.drop(plan.saves, BREAKER_OPEN)
            return
        marker = self.io.record_step()
        now = time.monotonic()
        for job in plan.saves:
            job.filled_at = now
        self.books.queue_saves(plan.namespace, plan.saves, marker)
        self._save_pool.submit(self._drain_saves)

    def wait_for_copies(self, req_ids: Sequence[str], timeout: float = 120.0) -> None:
        """Block until no copy-out of ``req_ids`` is pending (their blocks may be reused)."""
        self.books.wait_for_copies(req_ids, timeout)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose blocks may now be freed, requests whose loads are done).

        In a step without a forward pass that only waits for loads, wait briefly for one
        to land instead of returning at once: vLLM would otherwise spin through empty
        steps, taking the CPU the transfer needs (2-core hosts) for nothing.
        """
        if not self.defer_checks:
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
                if failed and self.failed_as_requests:
                    self._failed_requests.add(rid)
                else:
                    self._load_errors.update(failed)
                if first is not None:
                    self._report.load_failed[rid] = first
            self._done_loads.clear()
        return sending or None, recving or None

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed, reported once, where :attr:`failed_as_requests`."""
        with self._lock:
            failed, self._failed_requests = self._failed_requests, set()
        return failed

    def take_load_errors(self) -> AbstractSet[int]:
        """Block ids whose load failed, reported once (vLLM recomputes them).

        With :attr:`defer_checks` and layer-wise loads in the step, the answer is a
        :class:`~pegaflow.connector.loadcheck.DeferredLoadErrors`: the step's copies are checked
        when vLLM first reads it, so the engine's CPU goes on to schedule and launch the next step
        meanwhile (see :mod:`~pegaflow.connector.loadcheck`).
        """
        return self.layerwise.take_load_errors(self._take_errors)

    def _take_errors(self) -> set[int]:
        """The failed block ids noted so far (of loads other than this step's layer-wise
        ones), now forgotten."""
        with self._lock:
            errs, self._load_errors = self._load_errors, set()
        return errs

    def take_report(self) -> WorkerReport | None:
        """Outcomes the scheduler should learn from (None when there are none), with
        the nodes this worker's client knows to be down now."""
        down = sorted(self._client.health.down()) if self._client is not None else []
        if down:
            with self._lock:
                self.books.report.down_nodes = down
        return self.books.take_report()

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
                self.load_whole(ns, job, ok)
        except Exception:
            logger.exception("PegaFlow: load of %s failed", job.req_id)
        failed, first = self.books.account_load(job, ok, t0)
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

    def load_whole(self, ns: str, job: LoadJob, ok: list[bool]) -> None:
        """Route a load's blocks through the media in order: each takes the blocks it
        serves that an earlier one did not handle."""
        if self.io is None or self._remote is None or not ns or not job.block_ids:
            return
        client = self._get_client()
        if client is None:
            return
        handled: set[int] = set()
        for medium in self._media():
            if len(handled) == len(job.block_ids):
                return
            res = medium.load(client, ns, job, handled)
            self.books.collect(res)
            for i in res.ok:
                ok[i] = True
            handled |= res.handled

    def collect(self, result: LoadResult) -> None:
        """Learn from a medium's load result (:meth:`WorkerBooks.collect`)."""
        self.books.collect(result)

    def settle_layerwise(self, job: LoadJob, ok: list[bool], t0: float) -> list[int]:
        """Account a checked layer-wise load (started at ``t0``); returns its failed
        block ids (the request's first failed block goes to the report)."""
        return self.books.settle_layerwise(job, ok, t0)

    def _run_probe(self, ns: str, job: LoadJob) -> None:
        """Fetch a probe's blocks into staging memory (never into the KV cache) and
        report the time: the cost model's measurement of a declined node."""
        remote, client = self._remote, self._get_client()
        if remote is None or client is None or self.io is None or not ns or self._closed:
            return
        self.books.collect(remote.probe(client, ns, job))

    def _start_up(self, at_once: bool) -> None:
        """The worker's start-up work: the search for the node on this host and the
        mapping of its pool (what a first load waits for; the pool's pinning then goes
        on in a thread of its own), then the tile kernel's warm-up (its compiles).  In
        the background, or ``at_once`` where vLLM captures CUDA graphs (it does right
        after :meth:`register_kv_caches`): no CUDA call of ours may run beside the
        capture, which it would invalidate, but the pinning's (its thread is in CUDA's
        relaxed capture mode), and compiles beside the first requests would hold the
        GIL their lookups need.

        The client and its UCX worker are made first, here, while vLLM's thread waits:
        UCX reads the process environment as it opens a worker, and an engine's start
        changes the environment on other threads (made in the background, an engine
        once died inside UCX's reading of it)."""
        if self.settings.mode != "off":
            client = self._get_client()
            if client is not None:
                try:
                    client.open_transfers()
                except Exception as e:  # the first transfer opens it then
                    logger.warning("PegaFlow: cannot open the UCX worker yet: %s", e)
        steps = [self._discover] if self.settings.mode != "off" else []
        for step in [*steps, self._warm_up]:
            if at_once:
                step()
            else:
                self._load_pool.submit(step)

    def _warm_up(self) -> None:
        try:
            if self.io is not None:
                self.io.warm_up()
        except Exception as e:  # the first copy then compiles it
            logger.warning("PegaFlow: tile kernel warm-up failed: %s", e)

    def _pool_file(self, node: str) -> PoolFileMedium:
        assert self.io is not None
        s = self.settings
        path = LocalPath(self.io, node, s.transfer_timeout_s, s.verify_threads)
        return PoolFileMedium(path, self.io, self.shard, takes_pins=self.saves)

    def _discover(self) -> None:
        """Find the node on this host (unless ``local_node`` names it) and, with the
        same-host shortcut, map its pool (engine start, then retries while none is found)."""
        try:
            client = self._get_client()
            if client is None or self.io is None:
                return
            node = self.finder.find(client)
            if node and self.settings.same_host_shortcut and self._pool is None:
                pool = self._pool_file(node)
                pool.path.attach(client)
                self._pool = pool
            elif self._pool is not None:
                self._pool.path.attach(client)
        finally:
            self._local_ready.set()

    # ---- saves ---------------------------------------------------------------------

    def _drain_saves(self) -> None:
        """Run the queued save jobs (on the save thread), in order, small ones merged
        up to one same-host chunk (:meth:`WorkerBooks.take_saves`)."""
        assert self.io is not None
        chunk = save_chunk_blocks(self.io.block_bytes)
        while (queued := self.books.take_saves(chunk)) is not None:
            self._run_save_safe(*queued)

    def _run_save_safe(self, ns: str, job: SaveJob, marker: Any) -> None:
        # the job's blocks count as queued until each chunk is sent (then in flight) or
        # the job ends: a save being copied out is never uncounted (shutdown's books)
        self.books.save_started()
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
            self.books.save_ended(job)

    def _run_save(self, ns: str, job: SaveJob, marker: Any) -> None:
        """Hand a save job to the first medium that takes it (the pool file when it is
        mapped, else UCX)."""
        assert self.io is not None and self._remote is not None
        self.pool_ready(self.settings.rpc_timeout_s)  # saves right after engine start
        client = self._get_client()
        for medium in self._media():
            if medium.submit_save(client, ns, job, marker, self.books):
                return

    # ---- teardown ------------------------------------------------------------------

    def pending_saves(self) -> int:
        """Blocks of saves queued or in flight (not yet answered by a node)."""
        return self.books.pending_saves()

    def shutdown(self, wait_s: float | None = None) -> None:
        """Let pending saves finish, up to ``wait_s`` (default ``shutdown_wait_s``) in
        all; count and log (a warning) those still pending then; close the client."""
        if self._closed:
            return
        sameprocess.unregister(self)
        failed = self.layerwise.close()  # planned, never run: checked, their pins go back
        with self._lock:
            self._load_errors.update(failed)
        wait_s = self.settings.shutdown_wait_s if wait_s is None else wait_s
        t0 = time.monotonic()
        deadline = Deadline.after(wait_s)
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
            self._save_pool.submit(lambda: None).result(deadline.remaining())
        except concurrent.futures.TimeoutError:
            pass
        self._save_pool.shutdown(wait=False, cancel_futures=True)
        queued, inflight = self.books.close(deadline)  # later answers are not counted
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
        for medium in self._media():
            medium.close()
        c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception:
                pass
