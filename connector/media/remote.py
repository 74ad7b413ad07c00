"""The remote medium: KV blocks moved over UCX to and from any node, through host
staging memory.

Loads fetch a job's blocks in chunks straight into staging buffers (the client verifies
each block's checksum) and copy them whole into their vLLM blocks; the next chunks'
fetches overlap the current chunk's copy (``LOAD_DEPTH`` in flight).  Saves copy the
new blocks out into staging buffers (one memcpy per layer and block) and hand them to
the client's asynchronous put; a buffer is recycled when its put is answered.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from pegaflow.deadline import HOP_MARGIN_S, Deadline
from pegaflow.protocol.misses import unsaved_reason
from pegaflow.units import human_bytes

from ..discovery import LocalNodeFinder
from ..metadata import LoadJob, SaveJob, disk_source
from ..settings import ConnectorSettings
from .base import BREAKER_OPEN, LoadResult, SaveResult, SaveSink, chunks, gen_of, node_of
from .kvio import KVBlockIO
from .staging import Buf, Staging

logger = logging.getLogger("pegaflow.connector")

LOAD_DEPTH = 3
"""chunks of one load in flight at once"""
FIRST_CONTACT_S = 1.0
"""added to the budget of a load from a node this client has not heard from yet: it
also connects (a UCX endpoint and the hello, a few round trips; the staging memory is
ready from the start), so a node cut off before its first load costs a request about a
second more than a recompute, not ``transfer_timeout_s``"""


@dataclass(eq=False, repr=False)
class RemoteMedium:
    """Loads and saves over UCX through host staging memory (see the module docstring).

    Args:
        io: the worker's KV block copier.
        finder: the node on this host (saves go to it first).
        shard: this worker's shard.
        settings: connector settings (staging size, chunk size, deadlines).
        retry: retry blocks that failed once more before reporting them.
    """

    name = "remote"

    io: KVBlockIO
    finder: LocalNodeFinder
    shard: int
    settings: ConnectorSettings
    retry: bool = False

    def __post_init__(self) -> None:
        io, settings = self.io, self.settings
        chunk_blocks = max(1, settings.chunk_bytes // io.block_bytes)
        half = settings.max_staging_bytes // 2
        self.load_staging = Staging(io, chunk_blocks, half, min_chunks=LOAD_DEPTH)
        self.save_staging = Staging(io, chunk_blocks, half, min_chunks=1)
        if settings.can_load:
            self.load_staging.prefill(LOAD_DEPTH)
        if settings.can_save:
            self.save_staging.prefill(1)

    def load(self, client: Any, ns: str, job: LoadJob, skip: set[int]) -> LoadResult:
        """Fetch every block of ``job`` that a node holds, except those in ``skip``;
        one cost-model sample per node.  Handles all the job's blocks."""
        res = LoadResult(handled=set(range(len(job.block_ids))))
        t_remote = time.monotonic()
        try:
            self._run_remote(ns, job, res, client, skip)
        except Exception:
            logger.exception("PegaFlow: load of %s failed", job.req_id)
        self._sample_remote(job, res, skip, time.monotonic() - t_remote)
        return res

    def _run_remote(
        self,
        ns: str,
        job: LoadJob,
        res: LoadResult,
        client: Any,
        done_local: set[int],
    ) -> None:
        """The UCX part of a load: chunks fetched into staging, copied into the cache,
        all within the job's deadline (:meth:`deadline`); blocks of a node this client
        knows to be down are not asked for (they fail at once, and are computed)."""
        io, staging = self.io, self.load_staging
        deadline = self.deadline(client, job, done_local)
        health = client.health

        def wait_s() -> float:
            # a get gives up by itself by the deadline; a wait that lasts the hop margin
            # longer only guards a wedged client loop
            return deadline.remaining() + HOP_MARGIN_S

        def fetch(rows: range, buf: Buf, which: Sequence[int]) -> tuple[list[int], Any]:
            items: list[tuple[str, bytes, int, Any]] = []
            idx: list[int] = []
            unreachable = 0
            for i in which:
                nodes = job.nodes[i] if i < len(job.nodes) else []
                node = nodes[self.shard] if self.shard < len(nodes) else ""
                if not node or i in done_local:
                    continue
                if health.is_down(node):
                    unreachable += 1  # fails now, no wait: vLLM computes it
                    continue
                items.append((node, job.hashes[i], self.shard, buf[1][i - rows.start]))
                idx.append(i)
            if unreachable:
                res.count("load_unreachable_blocks", unreachable)
            if not items or deadline.expired:  # an expired get would only cut a connection
                return idx, None
            gens = [gen_of(job, self.shard, i) for i in idx]
            fut = client.submit_get_blocks(
                ns,
                items,
                timeout=deadline,
                generations=gens if any(g is not None for g in gens) else None,
                zero_copy=True,  # a staging buffer goes back to the pool once settled
            )
            return idx, fut

        def outcome(idx: list[int], fut: Any) -> tuple[list[int], list[int]]:
            got: list[bool] = [False] * len(idx)
            if fut is not None:
                try:
                    got = [bool(g) for g in fut.result(wait_s())]
                except Exception as e:
                    logger.warning("PegaFlow: get of %d blocks failed: %s", len(idx), e)
            if len(got) != len(idx):
                got = [False] * len(idx)
            good = [i for i, g in zip(idx, got, strict=True) if g]
            bad = [i for i, g in zip(idx, got, strict=True) if not g]
            return good, bad

        def complete(rows: range, buf: Buf, idx: list[int], fut: Any) -> None:
            good, bad = outcome(idx, fut)
            # once more only within the deadline, and into a buffer no failed get may
            # still write (a get into it would be refused)
            if bad and self.retry and not deadline.expired and client.settled(buf[1]):
                idx2, fut2 = fetch(rows, buf, bad)
                good2, _ = outcome(idx2, fut2)
                good = sorted(good + good2)
            if good:
                t0 = time.monotonic()
                io.scatter([job.block_ids[i] for i in good], buf[0], [i - rows.start for i in good])
                res.count("copy_seconds", time.monotonic() - t0)
                res.ok.update(good)

        def settled(buf: Buf) -> Callable[[], bool]:
            return lambda: bool(client.settled(buf[1]))

        pending: deque[tuple[range, Buf, list[int], Any]] = deque()
        try:
            for rows in chunks(len(job.block_ids), staging.chunk_blocks):
                buf = staging.acquire(wait=True, timeout=deadline.remaining())
                if buf is None:
                    logger.warning("PegaFlow: no staging memory for a load; blocks fail")
                    break
                idx, fut = fetch(rows, buf, rows)
                pending.append((rows, buf, idx, fut))
                if len(pending) >= LOAD_DEPTH:  # later chunks in flight while one lands
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
                        f.result(wait_s())
                    except Exception:
                        pass
                staging.release(b, settled(b))

    def deadline(self, client: Any, job: LoadJob, skip: AbstractSet[int] = frozenset()) -> Deadline:
        """When ``job``'s load from other hosts gives up (its blocks are then computed):
        after its budget (``LoadJob.budget_s``, about what computing them takes); a load
        from a node that has not answered this client yet (its blocks but those in
        ``skip``) also sets up its connection, and gets :data:`FIRST_CONTACT_S` more.
        Never after ``transfer_timeout_s``, the whole deadline without a budget."""
        limit = self.settings.transfer_timeout_s
        if job.budget_s > 0:
            n = len(job.block_ids)
            nodes = {node_of(job, self.shard, i) for i in range(n) if i not in skip}
            first = not all(client.health.has_answered(n) for n in nodes if n)
            limit = min(limit, job.budget_s + (FIRST_CONTACT_S if first else 0.0))
        return Deadline.after(limit)

    def _sample_remote(
        self, job: LoadJob, res: LoadResult, done_local: set[int], seconds: float
    ) -> None:
        """One measurement per node of a load's UCX part (its time split by bytes).  A
        node whose blocks all failed counts when it took long, or ran out the job's
        budget (a timeout is slow: slower than computing, which the budget is about)."""
        loaded: dict[str, int] = {}
        tried: dict[str, list[int]] = {}
        for i in range(len(job.block_ids)):
            node = node_of(job, self.shard, i)
            if not node or i in done_local:
                continue
            tried.setdefault(node, []).append(i)
            loaded[node] = loaded.get(node, 0) + (i in res.ok)
        total = sum(map(len, tried.values()))
        slow = seconds >= 0.1 or 0 < job.budget_s <= seconds
        for node, idx in tried.items():
            n = len(idx)
            blocks = loaded[node] or (n if slow else 0)
            if blocks:
                src = disk_source(node) if job.mostly_on_disk(idx) else node
                res.samples.append((src, blocks * self.io.block_bytes, seconds * n / total))

    def probe(self, client: Any, ns: str, job: LoadJob) -> LoadResult:
        """Fetch a probe's blocks into staging memory (never into the KV cache), chunk by
        chunk, and report the time: the cost model's measurement of a declined node."""
        res = LoadResult()
        staging = self.load_staging
        buf = staging.acquire(wait=False)
        if buf is None:
            return res  # loads need the staging memory more
        nodes: dict[str, int] = {}
        loaded = 0
        t0 = time.monotonic()
        try:
            for rows in chunks(len(job.hashes), staging.chunk_blocks):
                items = []
                for j, i in enumerate(rows):
                    node = node_of(job, self.shard, i)
                    if node:
                        nodes[node] = nodes.get(node, 0) + 1
                        items.append((node, job.hashes[i], self.shard, buf[1][j]))
                if items:
                    got = client.get_blocks(
                        ns, items, timeout=self.settings.transfer_timeout_s, zero_copy=True
                    )
                    loaded += sum(bool(g) for g in got)
        except Exception as e:
            logger.debug("PegaFlow: probe of %s failed: %s", job.req_id, e)
        finally:
            staging.release(buf, lambda: bool(client.settled(buf[1])))
        seconds = time.monotonic() - t0
        if len(nodes) == 1 and (loaded or seconds >= 0.1):
            node = next(iter(nodes))
            nbytes = (loaded or nodes[node]) * self.io.block_bytes
            disk = job.mostly_on_disk(range(len(job.hashes)))
            res.samples.append((disk_source(node) if disk else node, nbytes, seconds))
            res.count("probe_bytes", loaded * self.io.block_bytes)
        return res

    def submit_save(
        self, client: Any, ns: str, job: SaveJob, marker: Any, sink: SaveSink
    ) -> bool:
        """Copy ``job``'s blocks out into staging chunk by chunk and hand each to an
        asynchronous put (to this host's node first when there is one); chunks that
        cannot go (no client, breaker open, staging full) are dropped.  Always True."""
        io, staging = self.io, self.save_staging
        rows_all = chunks(len(job.block_ids), staging.chunk_blocks)
        for rows in rows_all:
            hashes = job.hashes[rows.start : rows.stop]
            if client is None or not sink.allow():
                rest = job.hashes[rows.start :]
                why = "no connection to the cluster" if client is None else BREAKER_OPEN
                sink.drop([SaveJob(job.req_id, [], rest)], why)
                return True
            buf = staging.acquire(wait=False)
            if buf is None:
                sink.drop(
                    [SaveJob(job.req_id, [], hashes)],
                    f"the save staging memory is full ({human_bytes(staging.max_bytes)}, half of "
                    "max_staging_bytes): blocks come faster than the cluster stores them; "
                    "raise max_staging_bytes, or run a node on this host",
                )
                continue
            try:
                t0 = time.monotonic()
                io.gather(job.block_ids[rows.start : rows.stop], buf[0], after=marker)
                copy_s = time.monotonic() - t0
                items = [(h, self.shard, buf[1][j]) for j, h in enumerate(hashes)]
                fut = client.submit_put_blocks(
                    ns,
                    items,
                    node_id=self.finder.node or None,
                    timeout=self.settings.transfer_timeout_s,
                )
            except Exception as e:
                staging.release(buf)
                sink.drop([SaveJob(job.req_id, [], hashes)], unsaved_reason(e))
                raise
            result = SaveResult(hashes, time.monotonic(), job.filled_at)
            sink.sent(len(hashes), copy_s)
            fut.add_done_callback(
                lambda f, buf=buf, result=result: self._put_done(f, buf, result, sink)
            )
        return True

    def _put_done(
        self,
        fut: concurrent.futures.Future[Any],
        buf: Buf,
        result: SaveResult,
        sink: SaveSink,
    ) -> None:
        self.save_staging.release(buf)
        result.take(fut)
        sink.answered(result)

    def close(self) -> None:
        """Nothing to release (the staging buffers go with the medium)."""
