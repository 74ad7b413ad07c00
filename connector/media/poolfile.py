"""The pool-file medium: KV blocks moved straight between vLLM's cache and the mapped
pool file of the storage node on this host (:class:`~.localpath.LocalPath`), no UCX hop.

Whole loads run on the load thread; layer-wise loads (:meth:`PoolFileMedium.start_layerwise`,
driven by :mod:`.layerwise`) are queued for the step's forward pass to wait on layer by
layer.  Saves are held from reuse until the node holds their commit.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pegaflow.protocol.codec import LocatedBlocks

from ..metadata import LOCAL, LoadJob, SaveJob, disk_source
from ..policy import LOCATE_PIN_S
from .base import BREAKER_OPEN, LoadResult, SaveResult, SaveSink, chunks, gen_of, node_of
from .kvio import KVBlockIO
from .localpath import LoadRequest, LocalPath, PendingLoad

logger = logging.getLogger("pegaflow.connector")

SAVE_CHUNK_BYTES = 256 << 20
"""KV bytes a same-host save reserves, copies out and commits at once.  Each chunk costs
a reservation round trip and a wait for its copies on the device, which on a GPU shared
by busy engines can be tens of ms; a request's blocks stay allocated in vLLM until its
last chunk is committed, so small chunks let saves fall behind and hold the KV cache
that new requests need.  One step of one request (``max_num_batched_tokens``) is at most
a few such chunks; the worker merges small queued jobs up to one chunk."""


def save_chunk_blocks(block_bytes: int) -> int:
    """Blocks of ``block_bytes`` in one same-host save chunk (``SAVE_CHUNK_BYTES``)."""
    return max(1, SAVE_CHUNK_BYTES // block_bytes)


SyncLoad = tuple[LoadJob, PendingLoad | list[bool], float]
"""a layer-wise load of a step: its job, its queued copies (or, failed to start, every
block's outcome) and when the step's loads started"""


@dataclass(eq=False, repr=False)
class PoolFileMedium:
    """Loads and saves through the pool file of this host's node (module docstring).

    Args:
        path: the mapped pool of the node on this host.
        io: the worker's KV block copier.
        shard: this worker's shard.
        takes_pins: this worker takes over (and releases) the scheduler's pins of its
            shard's located blocks; False: another rank of the same shard does (MLA),
            and this one locates them itself.
    """

    name = "pool-file"

    path: LocalPath
    io: KVBlockIO
    shard: int
    takes_pins: bool = True

    @property
    def node_id(self) -> str:
        """The node whose pool file this is."""
        return self.path.node_id

    def load(self, client: Any, ns: str, job: LoadJob, skip: set[int]) -> LoadResult:
        """Load the blocks held by this host's node through its pool file; they are the
        ones it handles (loaded or failed), which the UCX path then skips."""
        local = self.path
        res = LoadResult()
        idx = [
            i
            for i in range(len(job.block_ids))
            if node_of(job, self.shard, i) == local.node_id and i not in skip
        ]
        if not idx or not local.attach(client):
            return res
        res.handled = set(idx)
        t0 = time.monotonic()
        try:
            pending = local.start_load(
                client,
                ns,
                [job.hashes[i] for i in idx],
                self.shard,
                [job.block_ids[i] for i in idx],
            )
            res.ok = {i for i, good in zip(idx, pending.finish(), strict=True) if good}
            loaded = len(res.ok)
            res.count("local_load_blocks", loaded)
            if loaded and pending.learn:
                src = disk_source(LOCAL) if job.mostly_on_disk(idx) else LOCAL
                res.samples.append((src, loaded * self.io.block_bytes, time.monotonic() - t0))
        except Exception as e:
            logger.warning("PegaFlow: local load of %d blocks failed: %s", len(idx), e)
        res.count("copy_seconds", time.monotonic() - t0)
        return res

    def start_layerwise(
        self, client: Any, ns: str, jobs: list[LoadJob], t0: float, ahead: int = 0
    ) -> tuple[list[SyncLoad], LoadResult]:
        """Queue the copies of those of ``jobs`` whose blocks are all on this host's node,
        all at once so that their copies go layer-major (:meth:`LocalPath.start_loads`,
        ``ahead`` layers ahead of the forward pass, 0: all layers); returns them (the
        worker loads the others whole) and a result holding the counters to add."""
        res = LoadResult()
        local = self.path
        here = [
            j
            for j in jobs
            if all(node_of(j, self.shard, i) == local.node_id for i in range(len(j.block_ids)))
        ]
        if not here or not local.attach(client):
            return [], res
        out: list[SyncLoad] = []
        reqs = []
        for job in here:
            located = self._located(job)
            gens = [gen_of(job, self.shard, i) for i in range(len(job.block_ids))]
            reqs.append(LoadRequest(job.hashes, self.shard, job.block_ids, gens, located))
        try:
            got: list[PendingLoad | Exception] = local.start_loads(client, ns, reqs, ahead)
        except Exception as e:
            got = [e] * len(here)
        queued = time.monotonic() - t0
        for job, req, pending in zip(here, reqs, got, strict=True):
            if isinstance(pending, Exception):
                logger.warning("PegaFlow: layer-wise load of %s failed: %s", job.req_id, pending)
                out.append((job, [False] * len(job.block_ids), t0))
                continue
            out.append((job, pending, t0))
            res.count("located_load_jobs", req.located is not None)
            pending.queued_s = queued
            pending.located_here = req.located is None
        res.count("layerwise_start_seconds", queued)
        return out, res

    def _located(self, job: LoadJob) -> tuple[list[int], LocatedBlocks] | None:
        """The scheduler's locations of this shard's blocks, if they are still pinned
        for long enough (else None: the worker locates them itself)."""
        if not self.takes_pins:
            return None
        where = job.located[self.shard] if self.shard < len(job.located) else None
        if where is None or len(where) != len(job.block_ids) or self.shard >= len(job.pins):
            return None
        if time.monotonic() - job.located_at > LOCATE_PIN_S / 2:
            return None  # pins about to lapse; they expire on the node
        return [job.pins[self.shard]], where

    def submit_save(
        self, client: Any, ns: str, job: SaveJob, marker: Any, sink: SaveSink
    ) -> bool:
        """Copy ``job``'s blocks into reserved slots of the pool file and commit them,
        each chunk held from reuse until the node holds its commit; False when the pool
        file is not mapped (no client, or the node does not offer it)."""
        local = self.path
        if client is None or not local.attach(client):
            return False
        chunk = save_chunk_blocks(self.io.block_bytes)
        for rows in chunks(len(job.block_ids), chunk):
            hashes = job.hashes[rows.start : rows.stop]
            if not sink.allow():
                sink.drop([SaveJob(job.req_id, [], job.hashes[rows.start :])], BREAKER_OPEN)
                return True
            t0 = time.monotonic()
            taken = sink.hold_until_taken(job.holders, job.filled_at)
            try:
                fut = local.save(
                    client, ns, hashes, self.shard, job.block_ids[rows.start : rows.stop],
                    marker, taken,
                )  # fmt: skip
            except Exception as e:
                fut = concurrent.futures.Future()
                fut.set_exception(e)
            sink.sent(len(hashes), copy_s=time.monotonic() - t0)
            result = SaveResult(hashes, t0, job.filled_at)
            fut.add_done_callback(
                lambda f, result=result, taken=taken: self._commit_done(f, result, taken, sink)
            )
        return True

    @staticmethod
    def _commit_done(
        fut: concurrent.futures.Future[Any],
        result: SaveResult,
        taken: Callable[[], None],
        sink: SaveSink,
    ) -> None:
        try:
            result.take(fut)
            sink.answered(result)
        finally:
            taken()  # the commit failed, or the node never said it held it

    def close(self) -> None:
        """Unmap the pool file and stop the verify threads."""
        self.path.close()
