"""The worker's books: what the scheduler learns (the report), the save counts that
shutdown and delayed frees wait on, and the save breaker; kept under one lock from the
results of the storage media (:mod:`pegaflow.connector.media.base`): the books are the
media's :class:`~pegaflow.connector.media.base.SaveSink`."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pegaflow.deadline import Deadline
from pegaflow.protocol.misses import MAX_TEXT, unsaved_reason

from ..media.base import LoadResult, SaveResult
from ..metadata import LoadJob, SaveJob, WorkerReport, merge_saves
from ..metrics import Counters
from ..policy import CircuitBreaker
from ..settings import ConnectorSettings

logger = logging.getLogger("pegaflow.connector")


class WorkerBooks:
    """Counts and holds of one worker's transfers (see the module docstring).

    Args:
        settings: connector settings (the save breaker's thresholds).
        counters: the counters to update.
    """

    def __init__(self, settings: ConnectorSettings, counters: Counters) -> None:
        self.counters = counters
        self.lock = threading.Condition()
        """guards everything here, and the worker's load books"""
        self.report = WorkerReport()
        """outcomes for the scheduler, swapped out by :meth:`take_report`"""
        self.block_bytes = 0
        """bytes of one KV block of this shard (0 until the KV cache is registered)"""
        self.save_breaker = CircuitBreaker.of(settings)
        """opened by failing saves (shared by all media)"""
        self.closed = False
        """set at shutdown: answers that come later are not counted again"""
        self._save_queue: collections.deque[tuple[str, SaveJob, Any]] = collections.deque()
        """save jobs queued for the save thread (namespace, job, its step's marker)"""
        self.queued_saves = 0
        """blocks of save jobs queued or being copied out, not yet sent"""
        self.inflight_saves = 0
        """blocks handed to puts (or same-host commits) not yet answered"""
        self.pending_gathers: dict[str, int] = {}
        """holds on each request's blocks (save jobs, commits not yet held by the node)"""
        self._moved = 0
        """blocks of the running save job already sent (the save thread's own count)"""
        self._sampled: set[str] = set()
        """sources measured once already (see sample)"""
        self._last_drop_log = -1e9
        self._save_failing = False
        """whether the last save failed (its reason was logged once)"""

    # ---- the report ----------------------------------------------------------------

    def sample(self, source: str, size: float, seconds: float) -> None:
        """A measurement for the scheduler's cost model (sent with the next report); the
        first of each source is dropped: it paid one-off set-up (see costmodel)."""
        with self.lock:
            if source not in self._sampled:
                self._sampled.add(source)
                return
            if len(self.report.samples) < 256:
                self.report.samples.append((source, int(size), float(seconds)))

    def collect(self, result: LoadResult) -> None:
        """Learn from a medium's load (or probe): its counters and cost-model samples."""
        for name, n in result.counts:
            self.counters.add(name, n)
        for source, size, seconds in result.samples:
            self.sample(source, size, seconds)

    def take_report(self) -> WorkerReport | None:
        """Outcomes the scheduler should learn from (None when there are none)."""
        with self.lock:
            rep, self.report = self.report, WorkerReport()
        if rep.samples and self.block_bytes:
            rep.block_bytes = self.block_bytes
        return None if rep.is_empty() else rep

    # ---- loads ---------------------------------------------------------------------

    def account_load(
        self, job: LoadJob, ok: list[bool], t0: float
    ) -> tuple[list[int], int | None]:
        """Count a finished load; returns (failed block ids, first failed index)."""
        n = len(job.block_ids)
        failed = [job.block_ids[i] for i in range(n) if not ok[i]]
        first = next((job.first_block + i for i in range(n) if not ok[i]), None)
        loaded = n - len(failed)
        self.counters.add("load_jobs")
        self.counters.add("load_blocks", loaded)
        self.counters.add("load_bytes", loaded * self.block_bytes)
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

    def settle_layerwise(self, job: LoadJob, ok: list[bool], t0: float) -> list[int]:
        """Count a checked layer-wise load; returns its failed block ids (the request's
        first failed block goes to the report)."""
        failed, first = self.account_load(job, ok, t0)
        if first is not None:
            with self.lock:
                prev = self.report.load_failed.get(job.req_id, first)
                self.report.load_failed[job.req_id] = min(prev, first)
        return failed

    # ---- saves ---------------------------------------------------------------------

    def drop(self, jobs: Sequence[SaveJob], why: str) -> None:
        """Count blocks not saved, and say why (a warning at most every 10 s)."""
        n = sum(len(j.hashes) for j in jobs)
        with self.lock:
            for job in jobs:
                self.report.save_failed.extend(job.hashes)
                self.report.unsaved.setdefault(why[:MAX_TEXT], []).extend(job.hashes)
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

    def queue_saves(self, ns: str, jobs: Sequence[SaveJob], marker: Any) -> None:
        """Queue save jobs of namespace ``ns`` (their step's ``marker``) for the save
        thread: their blocks are held and count as queued."""
        self._save_queue.extend((ns, job, marker) for job in jobs)
        with self.lock:
            for job in jobs:
                self.pending_gathers[job.req_id] = self.pending_gathers.get(job.req_id, 0) + 1
                self.queued_saves += len(job.hashes)

    def take_saves(self, chunk_blocks: int) -> tuple[str, SaveJob, Any] | None:
        """The next queued save job (None: none), merged with those queued after it
        (same namespace) up to ``chunk_blocks`` (one same-host chunk,
        :func:`~pegaflow.connector.media.poolfile.save_chunk_blocks`): a backlog of small
        jobs (a block or two of each decoding request, a step) then costs one
        reservation, one copy and one commit per chunk, not per job, and so drains."""
        q = self._save_queue
        if not q:
            return None
        ns, job, marker = q.popleft()
        jobs = [job]
        room = chunk_blocks - len(job.block_ids)
        while q and q[0][0] == ns and len(q[0][1].block_ids) <= room:
            _, job, marker = q.popleft()  # a later step's marker: after the earlier ones
            jobs.append(job)
            room -= len(job.block_ids)
        now = time.monotonic()
        for j in jobs:
            if j.filled_at:
                self.counters.add("save_wait_seconds", now - j.filled_at)
        merged = merge_saves(jobs)
        self.merged(sum(len(j.hashes) for j in jobs) - len(merged.hashes))
        return ns, merged, marker

    def save_started(self) -> None:
        """The save thread starts a job (none of its blocks sent yet)."""
        with self.lock:
            self._moved = 0

    def allow(self) -> bool:
        """Whether saves may go now (the save breaker is closed)."""
        return self.save_breaker.allow()

    def sent(self, n: int, copy_s: float = 0.0) -> None:
        """``n`` blocks of the running save job went from queued to in flight, after
        ``copy_s`` seconds of copying them out."""
        self.counters.add("copy_seconds", copy_s)
        with self.lock:
            self.queued_saves -= n
            self.inflight_saves += n
            self._moved += n

    def merged(self, n: int) -> None:
        """``n`` queued blocks are stored once with the same blocks of another queued
        job (:func:`~pegaflow.connector.metadata.merge_saves`): no longer queued."""
        with self.lock:
            self.queued_saves -= n

    def save_ended(self, job: SaveJob) -> None:
        """The save thread is done with ``job``: its blocks not sent are uncounted and
        its holds end."""
        with self.lock:
            self.queued_saves -= len(job.hashes) - self._moved
            for req_id in job.holders:
                self._gathered(req_id)

    def _gathered(self, req_id: str) -> None:
        """One hold on ``req_id``'s blocks is over (a save job, or a same-host commit the
        node did not hold yet); at none, vLLM may reuse them.  Called with the lock."""
        left = self.pending_gathers.get(req_id, 1) - 1
        if left > 0:
            self.pending_gathers[req_id] = left
        else:
            self.pending_gathers.pop(req_id, None)
        self.lock.notify_all()

    def hold_until_taken(self, req_ids: Sequence[str], filled_at: float) -> Callable[[], None]:
        """Hold the blocks of ``req_ids`` (a save job's
        :attr:`~pegaflow.connector.metadata.SaveJob.holders`)
        from reuse until the callback returned is called (the node holds their commit:
        they are stored even if this process dies now); calls after the first do
        nothing.  ``filled_at``: when the step that filled them was queued (the hold is
        counted from then as ``save_hold_seconds``; 0: not counted)."""
        done = False

        def release() -> None:
            nonlocal done
            with self.lock:
                if done:
                    return
                done = True
                for req_id in req_ids:
                    self._gathered(req_id)
            if filled_at:
                self.counters.add("save_hold_seconds", time.monotonic() - filled_at)

        with self.lock:
            for req_id in req_ids:
                self.pending_gathers[req_id] = self.pending_gathers.get(req_id, 0) + 1
        return release

    def answered(self, result: SaveResult) -> None:
        """A save in flight was answered (stored or failed): account it."""
        try:
            self._record(result)
        finally:
            with self.lock:
                self.inflight_saves -= len(result.hashes)
                self.lock.notify_all()

    def _record(self, result: SaveResult) -> None:
        """Account the answer of a save (unless it came after shutdown)."""
        if self.closed:
            return  # answered after the bounded wait at shutdown: counted as dropped
        hashes, filled_at = result.hashes, result.filled_at
        now = time.monotonic()
        self.counters.add("save_seconds", now - result.started)
        res, e = result.reply, result.error
        if e is not None:
            if self.save_breaker.failure():
                logger.warning("PegaFlow: saves failing (%r); pausing them", e)
            elif not self._save_failing:
                logger.warning(
                    "PegaFlow: a save of %d blocks failed (%r); they are recomputed when needed",
                    len(hashes),
                    e,
                )
            self._save_failing = True
            with self.lock:
                self.report.save_failed.extend(hashes)
                self.report.unsaved.setdefault(unsaved_reason(e), []).extend(hashes)
            self.counters.add("save_failed_blocks", len(hashes))
            return
        if filled_at:
            self.counters.add("save_publish_seconds", now - filled_at)
        self.save_breaker.success()
        self._save_failing = False
        stored = int(getattr(res, "stored", 0))
        present = int(getattr(res, "skipped", 0))
        failed = int(getattr(res, "failed", 0))
        self.counters.add("save_blocks", stored)
        self.counters.add("save_present_blocks", present)
        self.counters.add("save_bytes", stored * self.block_bytes)
        if failed:
            self.counters.add("save_failed_blocks", failed)
            with self.lock:
                self.report.save_failed.extend(hashes)
                self.report.unsaved.setdefault("the node failed them", []).extend(hashes)

    def pending_saves(self) -> int:
        """Blocks of saves queued or in flight (not yet answered by a node)."""
        with self.lock:
            return self.queued_saves + self.inflight_saves

    def wait_for_copies(self, req_ids: Sequence[str], timeout: float) -> None:
        """Block until no copy-out of ``req_ids`` is pending (their blocks may be reused)."""
        deadline = Deadline.after(timeout)
        with self.lock:
            while any(self.pending_gathers.get(r, 0) for r in req_ids):
                if deadline.expired:
                    logger.error("PegaFlow: copy-out of preempted requests still pending")
                    return
                self.lock.wait(deadline.remaining())

    def close(self, deadline: Deadline) -> tuple[int, int]:
        """Wait until ``deadline`` for the saves in flight to be answered, then stop
        counting answers; returns the (queued, in flight) blocks still pending."""
        with self.lock:
            while self.inflight_saves and not deadline.expired:
                self.lock.wait(deadline.remaining())
            self.closed = True
            return self.queued_saves, self.inflight_saves
