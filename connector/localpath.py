"""The same-host shortcut of one worker: KV blocks copied straight between the KV cache
and the pool file of the storage node on this host, with no UCX hop.

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
same-host readers check against what lands in their own KV cache.

Anything that goes wrong makes the blocks misses (loads) or failures (saves), exactly
like the UCX path: the caller falls back or recomputes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from pegaflow.checksum import checksum

from .blockio import KVBlockIO, Transfer
from .hostpool import MappedPool

logger = logging.getLogger("pegaflow.connector")

_PIN_TTL_S = 10.0


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
        self.use_kernel = True
        """copy with the tile kernel where possible (False: always the copy engines)"""
        self._failed = False
        self._attach_lock = threading.Lock()

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
        try:
            info = client.call(lambda c: c.local_pool(self.node_id, self.timeout), self.timeout)
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

    # ---- loads ---------------------------------------------------------------------

    def start_load(
        self,
        client: Any,
        ns: str,
        hashes: Sequence[bytes],
        shard: int,
        block_ids: Sequence[int],
        gens: Sequence[int | None] | None = None,
    ) -> PendingLoad:
        """Pin, queue the copies and the checks; :meth:`PendingLoad.finish` waits for
        both and says which blocks are good.  ``gens``: the generation each block had at
        lookup (None: any); a slot holding another generation now is a miss (fencing)."""
        pool = self.pool
        assert pool is not None
        pin, where = client.call(
            lambda c: c.locate(
                ns, self.node_id, [(h, shard) for h in hashes], _PIN_TTL_S, self.timeout
            ),
            self.timeout,
        )
        bb = self.io.block_bytes
        idx = [
            i
            for i, w in enumerate(where)
            if w is not None
            and w.size == bb
            and (gens is None or gens[i] is None or gens[i] == w.gen)
        ]
        try:
            xfer = self.io.copy_in(
                pool.tensor,
                [where[i].offset for i in idx],
                [block_ids[i] for i in idx],
                mapped=pool.registered and self.use_kernel,
            )
            if self.io.can_digest and all(where[i].digest is not None for i in idx):
                # verify what landed in the KV cache, on the device, after the copies
                match = self.io.digest(
                    [block_ids[i] for i in idx], expect=[where[i].digest for i in idx]
                )
                check: Any = (match, self.io.stream_event())
            else:  # no device digest (e.g. written before a node restart): xxh3 on host
                check = [
                    (where[i].xxh3, self._verify.submit(checksum, pool.view(where[i].offset, bb)))
                    for i in idx
                ]
        except BaseException:
            self._unpin(client, pin)
            raise
        return PendingLoad(self, client, pin, len(hashes), idx, check, xfer)

    def _unpin(self, client: Any, pin: int) -> None:
        """Release a pin without waiting for the answer (the copies are done; a lost
        unpin only keeps the blocks from eviction until the pin expires on the node)."""
        try:
            fut = client.submit(lambda c: c.unpin(self.node_id, pin, self.timeout))
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
    ) -> Any:
        """Store KV blocks through the pool file; returns the node's put outcome."""
        pool = self.pool
        assert pool is not None
        bb = self.io.block_bytes
        seq, offsets = client.call(
            lambda c: c.reserve_local(
                ns, self.node_id, [(h, shard, bb) for h in hashes], self.timeout
            ),
            self.timeout,
        )
        idx = [i for i, o in enumerate(offsets) if o is not None]
        ids = [block_ids[i] for i in idx]
        try:
            digests = (
                self.io.digest(ids, stream="save", after=after) if self.io.can_digest else None
            )
            self.io.copy_out(
                ids,
                pool.tensor,
                [offsets[i] for i in idx],  # type: ignore[misc]
                mapped=pool.registered and self.use_kernel,
                after=after,
            )
        except BaseException:
            try:
                client.call(lambda c: c.abort_local(self.node_id, seq, self.timeout), self.timeout)
            except Exception:
                pass  # the reservation expires on the node
            raise
        digs: list[int | None] | None = None
        if digests is not None:  # copy_out synchronized the save stream: they are done
            digs = [None] * len(hashes)
            for i, d in zip(idx, digests.tolist(), strict=True):
                digs[i] = int(d)
        return client.call(
            lambda c: c.commit_local(
                self.node_id, seq, [o is not None for o in offsets], self.timeout, digs
            ),
            self.timeout,
        )

    def close(self) -> None:
        """Stop the checksum threads and unmap the pool."""
        self._verify.shutdown(wait=True)
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def _log_unpin_failure(fut: concurrent.futures.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.debug("PegaFlow: unpin failed: %s", fut.exception())


class PendingLoad:
    """A local load whose copies and checks are under way.

    ``check`` is either ``(match, event)``, a device bool tensor saying per block
    whether the digest of what landed in the KV cache equals the writer's, done at
    ``event``; or a list of ``(wanted xxh3, future of the recomputed xxh3)``.
    """

    def __init__(
        self,
        path: LocalPath,
        client: Any,
        pin: int,
        n: int,
        idx: list[int],
        check: Any,
        xfer: Transfer,
    ) -> None:
        self._path = path
        self._client = client
        self._pin = pin
        self._n = n
        self._idx = idx
        self._check = check
        self.transfer = xfer
        self.on_device = isinstance(check, tuple)
        """whether the blocks are verified on the device (digest) rather than on host"""

    def finish(self) -> list[bool]:
        """Wait for the copies and checks; per block, whether its verified bytes are in."""
        ok = [False] * self._n
        try:
            self.transfer.synchronize()
            if self.on_device:
                match, event = self._check
                if event is not None:
                    event.synchronize()
                good = match.cpu().tolist()
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
            self._path._unpin(self._client, self._pin)
        return ok
