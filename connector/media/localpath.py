"""Same-host path of one worker: KV blocks copied between the KV cache and this host's pool.

KV blocks go straight between vLLM's cache and the pool file of the storage node on this
host, with no UCX hop.

Loads: ``locate`` pins the blocks on the node and says where they are in its pool file;
the copies into the KV cache are queued (one kernel per layer from pinned memory, or
DMA).  Then every block is verified: on the device, by the digest of what landed in the
KV cache against the digest the writer computed from its own KV cache (cheap, and it
checks the bytes vLLM will use); or, for blocks without one, by recomputing the xxh3
from the file on CPU threads (xxhash releases the GIL).  A block counts as loaded only
when its check passes.  The pin is released once the copies are done, so the slots
cannot be evicted and reused while they are read.

Saves: a local ``reserve`` gives slot offsets; the KV blocks are copied into them; the
node hashes each slot (its xxh3 becomes the block's checksum, for UCX readers and
restarts) and keeps the device digest the writer computed from its KV cache, which
same-host readers check against what lands in their own KV cache.  The blocks are
saved for good once the node holds the commit (it carries it out even if this process
dies then), which it says within a round trip, while it still hashes.

Every request goes through the client's session with the node
(:class:`~pegaflow.client.session.NodeSession`): straight over the node's control
socket, whose path the search for the node on this host learned with its pool file.

Anything that goes wrong makes the blocks misses (loads) or failures (saves), exactly
like the UCX path: the caller falls back or recomputes.

The node may be restarted on a new pool file at the same path (a cleaned ``/dev/shm``,
a new emptyDir) while this process still maps the old one.  Every reservation names
the file its writer maps, and the node refuses another (:class:`PoolChanged`); every
``locate`` answer names the node's file, and a load from another file is refused here.
Either way the mapping is retired (unmapped a minute later, when no copy can still use
it) and the node's new file is mapped at the next request.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pegaflow.checksum import checksum
from pegaflow.errors import PoolChanged, Unavailable
from pegaflow.protocol.codec import LocatedBlocks

from ..policy import LOCATE_PIN_S, MAX_LOCATE
from .hostpool import MappedPool
from .kvio import KVBlockIO
from .layerfeed import CopyIn, Transfer

logger = logging.getLogger("pegaflow.connector")

RETIRED_UNMAP_S = 60.0
"""how long a mapping of a pool file the node no longer uses stays mapped after it was
retired: copies queued from it before then have long finished"""


@dataclass(frozen=True)
class LoadRequest:
    """One load of :meth:`LocalPath.start_loads`: ``hashes`` of ``shard`` into KV blocks
    ``block_ids``.  ``gens``: the generation each block had at lookup (None: any); a
    slot holding another generation now is a miss (fencing).  ``located``: ``(pins,
    where)`` from a ``locate`` made earlier (by the scheduler, while it looked the
    blocks up), whose pins the load takes over and releases."""

    hashes: Sequence[bytes]
    shard: int
    block_ids: Sequence[int]
    gens: Sequence[int | None] | None = None
    located: tuple[list[int], LocatedBlocks] | None = None


@dataclass
class _Picked:
    """A load located and picked, its copies not yet queued."""

    pool: MappedPool
    pins: list[int]
    n: int
    idx: list[int]
    sel: np.ndarray
    where: LocatedBlocks
    offsets: list[int]
    block_ids: list[int]
    on_device: bool


class LocalPath:
    """Direct access to the pool of ``node_id`` (the node on this host).

    Args:
        io: the worker's KV block copier.
        node_id: the local node's id.
        timeout: deadline of each control call and of a whole transfer.
        verify_threads: CPU threads that recompute checksums (0: ``min(16, cpus)``).
    """

    def __init__(
        self, io: KVBlockIO, node_id: str, timeout: float, verify_threads: int = 0
    ) -> None:
        self.io = io
        self.node_id = node_id
        self.timeout = timeout
        n = verify_threads or min(16, os.cpu_count() or 1)
        self._verify = concurrent.futures.ThreadPoolExecutor(n, "pegaflow-verify")
        self.pool: MappedPool | None = None
        self.copy_mode = "auto"
        """how loads copy (see :meth:`KVBlockIO.copy_in`); ``dma`` also keeps saves off
        the tile kernel"""
        self._failed = False
        self._attach_lock = threading.Lock()
        self._retired: list[tuple[float, MappedPool]] = []
        """mappings of pool files the node replaced, with when they were retired"""

    def attach(self, client: Any) -> bool:
        """Map the node's pool if it offers it and this process can open it (once)."""
        if self.pool is not None:
            return True
        with self._attach_lock:
            return self._attach(client)

    def _attach(self, client: Any) -> bool:
        if self.pool is not None:
            return True
        if self._failed:
            return False
        self._unmap_retired(time.monotonic() - RETIRED_UNMAP_S)
        try:
            info = client.node_session(self.node_id).pool_file(self.timeout)
            if info is None:
                raise OSError("the node does not offer its pool file to this client")
            self.pool = MappedPool(info, self.io.device)
        except Exception as e:
            self._failed = True
            logger.info(
                "PegaFlow: same-host shortcut to node %s off (%s); blocks go over UCX",
                self.node_id,
                e,
            )
            return False
        logger.info("PegaFlow: same-host shortcut to node %s (%s)", self.node_id, info.path)
        return True

    def _pool_changed(self, client: Any, pool: MappedPool, why: str) -> PoolChanged:
        """The node's pool is another file than ``pool`` now: retire the mapping (the next
        :meth:`attach` maps the node's file) and make the session learn it anew."""
        with self._attach_lock:
            if self.pool is pool:
                self.pool = None
                self._retired.append((time.monotonic(), pool))
                logger.warning(
                    "PegaFlow: node %s no longer uses the pool file this engine mapped (%s): "
                    "it was restarted on a new file; mapping the new one",
                    self.node_id, why,
                )  # fmt: skip
                try:
                    client.node_session(self.node_id).forget_pool(self.timeout)
                except Exception as e:
                    logger.debug("PegaFlow: forgetting node %s's pool failed: %s", self.node_id, e)
        return PoolChanged(why)

    def _unmap_retired(self, before: float) -> None:
        """Unmap the retired mappings retired before ``before`` (monotonic time)."""
        keep = []
        for at, pool in self._retired:
            if at <= before:
                pool.close()
            else:
                keep.append((at, pool))
        self._retired = keep

    def _mapped(self) -> MappedPool:
        """The current mapping (:meth:`attach` made it; a pool change may have retired it
        since)."""
        pool = self.pool
        if pool is None:
            raise Unavailable("the node's pool file is being mapped again")
        return pool

    # ---- loads ---------------------------------------------------------------------

    def start_load(
        self,
        client: Any,
        ns: str,
        hashes: Sequence[bytes],
        shard: int,
        block_ids: Sequence[int],
        gens: Sequence[int | None] | None = None,
        located: tuple[list[int], LocatedBlocks] | None = None,
    ) -> PendingLoad:
        """Pin, queue the copies and the checks of one load (:meth:`start_loads`)."""
        got = self.start_loads(client, ns, [LoadRequest(hashes, shard, block_ids, gens, located)])
        if isinstance(got[0], BaseException):
            raise got[0]
        return got[0]

    def start_loads(
        self, client: Any, ns: str, loads: Sequence[LoadRequest], ahead: int = 0
    ) -> list[PendingLoad | Exception]:
        """Pin, then queue the copies and the checks of several loads at once (a step's
        layer-wise loads: their copies go layer by layer across all of them, see
        :meth:`KVBlockIO.copy_in_many`); :meth:`PendingLoad.finish` waits for each and
        says which blocks are good.  Per load a :class:`PendingLoad`, or the error that
        stopped it before its copies (its blocks are then misses).  ``ahead``: layers
        queued ahead of the forward pass (0: all at once, :meth:`KVBlockIO.copy_in_many`)."""
        pool = self._mapped()
        picked: list[_Picked | Exception] = []
        for ld in loads:
            try:
                picked.append(self._pick(client, ns, ld, pool))
            except Exception as e:
                picked.append(e)
        ready = [p for p in picked if isinstance(p, _Picked)]
        # a load that pins pieces of the pool first takes longer than the same load will
        pinner = pool.pinner
        learn = iter([pinner is None or pinner.failed or pinner.pinned(p.offsets) for p in ready])
        copies = [
            CopyIn(
                pool.tensor, p.offsets, p.block_ids, pool.pinned(p.offsets), p.on_device, pool.piece
            )
            for p in ready
        ]
        try:
            with pool.hold_off_pinning():
                xfers = iter(self.io.copy_in_many(copies, mode=self.copy_mode, ahead=ahead))
        except BaseException:
            for p in ready:
                self._unpin(client, p.pins)
            raise
        out: list[PendingLoad | Exception] = []
        for p in picked:
            if isinstance(p, Exception):
                out.append(p)
                continue
            xfer = next(xfers)
            try:
                pending = PendingLoad(self, client, p.pins, p.n, p.idx, self._check(p, xfer), xfer)
                pending.learn = next(learn)
                out.append(pending)
            except Exception as e:
                self._unpin(client, p.pins)
                out.append(e)
        return out

    def _pick(self, client: Any, ns: str, ld: LoadRequest, pool: MappedPool) -> _Picked:
        """Locate (unless the scheduler did) and pick the blocks to copy: those whose
        slot holds a block of the right size and generation, in the file ``pool`` maps."""
        pins, where = (
            ld.located if ld.located is not None else self._locate(client, ns, ld.hashes, ld.shard)
        )
        try:
            if where.pool != pool.info.file_id:
                raise self._pool_changed(
                    client, pool, f"the node located blocks in pool file {where.pool}"
                )
            ok = where.found & (where.column("size") == self.io.block_bytes)
            if ld.gens is not None:
                known = np.array([g is not None for g in ld.gens], dtype=bool)
                want = np.array([g or 0 for g in ld.gens], dtype=np.uint64)
                ok &= ~known | (where.column("gen") == want)
            sel = np.flatnonzero(ok)
            idx = sel.tolist()
            return _Picked(
                pool=pool,
                pins=pins,
                n=len(ld.hashes),
                idx=idx,
                sel=sel,
                where=where,
                offsets=where.column("offset")[sel].tolist(),
                block_ids=[ld.block_ids[i] for i in idx],
                on_device=self.io.can_digest and bool(where.has_digest[sel].all()),
            )
        except BaseException:
            self._unpin(client, pins)
            raise

    def _check(self, p: _Picked, xfer: Transfer) -> Any:
        """What :meth:`PendingLoad.finish` checks: on the device, the digests of what
        landed in the KV cache against the writer's; else the xxh3 of each slot,
        recomputed on host threads, against the node's."""
        if p.on_device:
            assert xfer.digests is not None
            return xfer.digests, p.where.column("digest")[p.sel]
        pool = p.pool
        bb = self.io.block_bytes
        return [
            (want_sum, self._verify.submit(checksum, pool.view(off, bb)))
            for want_sum, off in zip(p.where.column("xxh3")[p.sel].tolist(), p.offsets, strict=True)
        ]

    def _locate(
        self, client: Any, ns: str, hashes: Sequence[bytes], shard: int
    ) -> tuple[list[int], LocatedBlocks]:
        """Pin the blocks and learn where they are (in calls of at most MAX_LOCATE)."""
        pins: list[int] = []
        parts: list[LocatedBlocks] = []
        node = client.node_session(self.node_id)
        try:
            for i in range(0, len(hashes), MAX_LOCATE):
                part = hashes[i : i + MAX_LOCATE]
                pin, got = node.locate_here(ns, part, shard, LOCATE_PIN_S, self.timeout)
                pins.append(pin)
                parts.append(got)
        except BaseException:
            self._unpin(client, pins)
            raise
        return pins, LocatedBlocks.concat(parts)

    def _unpin(self, client: Any, pins: Sequence[int]) -> None:
        """Release pins without waiting for the answer (the copies are done; a lost
        unpin only keeps the blocks from eviction until the pin expires on the node)."""
        for pin in pins:
            try:
                fut = client.node_session(self.node_id).submit_unpin(pin, self.timeout)
                fut.add_done_callback(_log_unpin_failure)
            except Exception as e:
                logger.debug("PegaFlow: unpin failed: %s", e)

    # ---- saves ---------------------------------------------------------------------

    def save(
        self,
        client: Any,
        ns: str,
        hashes: Sequence[bytes],
        shard: int,
        block_ids: Sequence[int],
        after: Any = None,
        on_taken: Callable[[], None] | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Store KV blocks through the pool file.  Returns when the blocks are copied out
        of the KV cache, with a future of the node's put outcome (the node hashes and
        publishes them meanwhile).  ``on_taken`` is called (on the client's loop) once
        the node holds the commit and stores the blocks whatever happens to this
        process (see :meth:`NodeSession.commit_local`): only then are the blocks saved for
        good.  It is not called when this raises."""
        pool = self._mapped()
        bb = self.io.block_bytes
        node = client.node_session(self.node_id)
        try:
            seq, offsets = node.reserve_local(
                ns, [(h, shard, bb) for h in hashes], pool.info.file_id, self.timeout
            )
        except PoolChanged as e:
            raise self._pool_changed(client, pool, str(e)) from None
        idx = [i for i, o in enumerate(offsets) if o is not None]
        ids = [block_ids[i] for i in idx]
        try:
            with pool.hold_off_pinning():
                digests = self.io.copy_out(
                    ids,
                    pool.tensor,
                    [offsets[i] for i in idx],  # type: ignore[misc]
                    mapped=self.copy_mode != "dma" and pool.pinned([offsets[i] for i in idx]),
                    after=after,
                    digest=self.io.can_digest,
                )
        except BaseException:
            try:
                node.abort_local(seq, self.timeout)
            except Exception:
                pass  # the reservation expires on the node
            raise
        digs: list[int | None] | None = None
        if digests is not None:  # copy_out synchronized the save stream: they are done
            digs = [None] * len(hashes)
            for i, d in zip(idx, self.io.to_host(digests).tolist(), strict=True):
                digs[i] = int(d)
        return node.submit_commit_local(
            seq, [o is not None for o in offsets], self.timeout, digs, on_taken
        )

    def close(self) -> None:
        """Stop the checksum threads and unmap the pool."""
        self._verify.shutdown(wait=True)
        self._unmap_retired(float("inf"))
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def _log_unpin_failure(fut: concurrent.futures.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.debug("PegaFlow: unpin failed: %s", fut.exception())


@dataclass(eq=False, repr=False)
class PendingLoad:
    """A local load whose copies and checks are under way (built by
    :meth:`LocalPath.start_load`, its arguments in this order).

    ``_check`` is either ``(digests, wanted)``: a device int64 tensor of the digests of
    what landed in the KV cache (done with the transfer's last event) and a numpy
    array of the writer's; or a list of ``(wanted xxh3, future of the recomputed xxh3)``.
    """

    _path: LocalPath
    _client: Any
    _pins: list[int]
    _n: int
    _idx: list[int]
    _check: Any
    transfer: Transfer
    on_device: bool = field(init=False)
    """whether the blocks are verified on the device (digest) rather than on host"""
    queued_s: float = field(default=0.0, init=False)
    """CPU time it took to queue (set by the worker, for its log)"""
    located_here: bool = field(default=True, init=False)
    """whether the loader located the blocks itself (else the scheduler did)"""
    learn: bool = field(default=True, init=False)
    """whether its time teaches the cost model: not where it pinned pieces of the pool
    first (an engine's first loads while the pool is being pinned)"""

    def __post_init__(self) -> None:
        self.on_device = isinstance(self._check, tuple)

    def finish(self) -> list[bool]:
        """Wait for the copies and checks; per block, whether its verified bytes are in."""
        ok = [False] * self._n
        try:
            self.transfer.synchronize()
            if self.transfer.failed:
                return ok
            if self.on_device:
                digests, want = self._check
                good = (self._path.io.to_host(digests) == want).tolist()
            else:
                good = []
                for want, fut in self._check:
                    try:
                        good.append(fut.result(self._path.timeout) == want)
                    except Exception:
                        good.append(False)
            for i, g in zip(self._idx, good, strict=True):
                ok[i] = bool(g)
                if not g:
                    logger.warning("PegaFlow: a block from the local pool failed its check: a miss")
        finally:
            self._path._unpin(self._client, self._pins)
        return ok
