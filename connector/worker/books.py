"""The worker's books: what the scheduler learns (the report), the save counts that
shutdown and delayed frees wait on, and the save breaker; shared by the worker and its
storage media under one lock."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pegaflow.deadline import Deadline

from ..metadata import SaveJob, WorkerReport
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
        self.save_breaker = CircuitBreaker(
            settings.failures_to_backoff, settings.backoff_s, settings.backoff_max_s
        )
        """opened by failing saves (shared by all media)"""
        self.closed = False
        """set at shutdown: answers that come later are not counted again"""
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

    def take_report(self) -> WorkerReport | None:
        """Outcomes the scheduler should learn from (None when there are none)."""
        with self.lock:
            rep, self.report = self.report, WorkerReport()
        if rep.samples and self.block_bytes:
            rep.block_bytes = self.block_bytes
        return None if rep.is_empty() else rep

    # ---- saves ---------------------------------------------------------------------

    def drop(self, jobs: Sequence[SaveJob], why: str) -> None:
        """Count blocks not saved, and say why (a warning at most every 10 s)."""
        n = sum(len(j.hashes) for j in jobs)
        with self.lock:
            for job in jobs:
                self.report.save_failed.extend(job.hashes)
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

    def queue_saves(self, jobs: Sequence[SaveJob]) -> None:
        """Save jobs were queued: their blocks are held and count as queued."""
        with self.lock:
            for job in jobs:
                self.pending_gathers[job.req_id] = self.pending_gathers.get(job.req_id, 0) + 1
                self.queued_saves += len(job.hashes)

    def save_started(self) -> None:
        """The save thread starts a job (none of its blocks sent yet)."""
        with self.lock:
            self._moved = 0

    def sent(self, n: int) -> None:
        """``n`` blocks of the running save job went from queued to in flight."""
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

    def put_answered(self, n: int) -> None:
        """``n`` blocks in flight were answered (stored or failed)."""
        with self.lock:
            self.inflight_saves -= n
            self.lock.notify_all()

    def record_put(
        self,
        fut: concurrent.futures.Future[Any],
        hashes: list[bytes],
        started: float,
        filled_at: float,
    ) -> None:
        """Account the answer ``fut`` of a save of ``hashes`` sent at ``started``, of
        blocks filled at ``filled_at`` (:attr:`SaveJob.filled_at`)."""
        if self.closed:
            return  # answered after the bounded wait at shutdown: counted as dropped
        now = time.monotonic()
        self.counters.add("save_seconds", now - started)
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
            with self.lock:
                self.report.save_failed.extend(hashes)
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
