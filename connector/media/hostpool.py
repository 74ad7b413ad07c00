"""A storage node's pool file, mapped into this process (the same-host shortcut).

When the connector's node runs on its own host, the node offers its pool file in the
data-plane handshake (path plus device and inode numbers).  The connector maps it and
copies blocks straight between the file's pages and the KV cache: no UCX hop and no
staging copy.  The node still owns the pool: reads go through ``locate`` (which pins
the blocks while they are copied) and writes through a local ``reserve`` / ``commit``
(the node checks every written slot's xxh3 before publishing it).

On a CUDA device the mapping is registered with the driver (``cudaHostRegister``,
portable and mapped), so the copy engines DMA at full speed and GPU kernels can read
and write the file's pages directly.  Registration pins every page of the pool; it runs
in a background thread (:class:`PoolPinner`) so that engine start is not delayed, one
small piece at a time, from the moment the engine registers its KV cache: beside vLLM's
CUDA graph capture too (:func:`relax_capture_mode`), so that the pool is pinned by the
engine's first request.  A load or save whose blocks lie in pieces not pinned yet pins
those itself first (:meth:`PoolPinner.pin_now`); only once pinning failed do copies use
the mapping like pageable memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from pegaflow.client.samehost import PoolFile, open_pool_file

log = logging.getLogger("pegaflow.connector")

_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02
PIN_PIECE = 64 << 20
"""the pool is pinned this many bytes at a time (at least; a multiple of the node's slab
size, so no block spans two pieces): each registration holds the CUDA driver's lock,
and a load's copies queued meanwhile wait for it to end"""
_MADV_POPULATE_WRITE = 23
"""Linux 5.14: fault a range's pages in for writing"""
PIECE_WAIT_S = 2.0
"""longest a load waits for the registration of a piece it needs that another thread is
making (about 10 ms a piece; longer: the copy goes the pageable way)"""
HOLD_OFF_S = 0.05
"""longest a piece's registration waits for copies being queued (:meth:`PoolPinner.hold_off`)
to be queued: pinning goes on under steady load"""


def pin_piece(slab_bytes: int) -> int:
    """The piece size for a pool of ``slab_bytes`` slabs (0: unknown, an older node:
    its pool was pinned in 1 GiB pieces, a multiple of any slab size it allowed)."""
    if slab_bytes <= 0:
        return 1 << 30
    return slab_bytes * max(1, -(-PIN_PIECE // slab_bytes))


def _populate(ptr: int, size: int) -> None:
    """Fault ``[ptr, ptr + size)`` in before it is pinned: page-table work done here,
    outside the driver's lock (ctypes hands the GIL back meanwhile); best effort (an
    older kernel refuses it, and registration faults the pages in itself)."""
    try:
        _libc().madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(size), _MADV_POPULATE_WRITE)
    except (OSError, AttributeError):
        pass


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


_CAPTURE_MODE_RELAXED = 2
"""``CU_STREAM_CAPTURE_MODE_RELAXED``"""


def relax_capture_mode() -> bool:
    """Let this thread's CUDA calls run while another thread captures a CUDA graph
    (vLLM's start): in the default (global) mode a registration beside a capture would
    invalidate it.  PyTorch does the same around its own pinned host allocations.
    Returns whether the driver took it (False: no CUDA driver)."""
    try:
        mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
        cuda = ctypes.CDLL("libcuda.so.1")
        return cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
    except (OSError, AttributeError):
        return False


class PoolPinner:
    """Which pieces of a mapped pool are pinned, and the thread that pins them in order,
    each once no copy is being queued (:meth:`hold_off`; ``hold_off_s`` at most); a
    load or save pins the pieces it needs itself, at once (:meth:`pin_now`).

    ``register(offset, size)`` pins one piece and returns the CUDA error code (0: done);
    ``unregister(offset)`` undoes one.  Pure bookkeeping around them, so it is tested
    without a GPU.
    """

    def __init__(
        self,
        size: int,
        piece: int,
        register: Callable[[int, int], int],
        unregister: Callable[[int], None],
        populate: Callable[[int, int], None] | None = None,
        hold_off_s: float = HOLD_OFF_S,
    ) -> None:
        self.size = size
        self.hold_off_s = hold_off_s
        self.piece = piece
        self._register = register
        self._unregister = unregister
        self._populate = populate
        n = -(-size // piece)
        self._pinned = np.zeros(n, dtype=bool)
        self._busy: set[int] = set()
        """pieces being pinned now (by the pinning thread or by :meth:`pin_now`)"""
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)
        self._settled = threading.Condition(self._lock)
        """notified when a piece's registration ends"""
        self._queueing = 0
        """copies being queued now (:meth:`hold_off`)"""
        self._stop = threading.Event()
        self.failed = False
        self.done = threading.Event()
        """set when every piece is pinned or pinning gave up"""
        self.seconds = 0.0

    @property
    def complete(self) -> bool:
        """Whether every piece is pinned."""
        return bool(self._pinned.all())

    def pinned(self, offsets: Sequence[int]) -> bool:
        """Whether every block at ``offsets`` lies in a pinned piece."""
        if not len(offsets):
            return self.complete
        idx = np.asarray(offsets, dtype=np.int64) // self.piece
        return bool(self._pinned[idx].all())

    def pin_now(self, offsets: Sequence[int]) -> bool:
        """Pin the pieces of the blocks at ``offsets`` on this thread, those not pinned
        yet (an engine's first loads while the pool is being pinned: copying from
        unpinned pages is several times slower than pinning them first, about 10 ms a
        64 MiB piece); returns whether all of them are pinned (False: pinning failed or
        was stopped, the copies go the pageable way)."""
        if self.pinned(offsets):
            return True
        if self.done.is_set() or self._stop.is_set() or self.failed:
            return False
        for i in np.unique(np.asarray(offsets, dtype=np.int64) // self.piece).tolist():
            with self._lock:
                if not self._settled.wait_for(lambda i=i: i not in self._busy, PIECE_WAIT_S):
                    return False  # a registration stuck in the driver: the pageable way
                if self._pinned[i]:
                    continue
                self._busy.add(i)
            if not self._pin(i):
                return False
        return self.pinned(offsets)

    def _pin(self, i: int) -> bool:
        """Pin piece ``i`` (marked busy by the caller)."""
        off = i * self.piece
        n = min(self.piece, self.size - off)
        code = -1
        try:
            if self._populate is not None:
                self._populate(off, n)
            code = self._register(off, n)
        finally:
            with self._lock:
                self._busy.discard(i)
                self._pinned[i] = code == 0
                self._settled.notify_all()
        if code != 0:
            self.failed = True
            log.warning(
                "PegaFlow: cudaHostRegister of the node's pool failed (error %d); "
                "copies from it run at pageable-memory speed",
                code,
            )
        return code == 0

    @contextlib.contextmanager
    def hold_off(self) -> Iterator[None]:
        """While a load or save queues its copies: no registration starts meanwhile (a
        registration holds the driver's lock, which each copy call needs)."""
        with self._lock:
            self._queueing += 1
        try:
            yield
        finally:
            with self._lock:
                self._queueing -= 1
                if not self._queueing:
                    self._quiet.notify_all()

    def _wait_quiet(self) -> None:
        with self._lock:
            self._quiet.wait_for(lambda: not self._queueing, self.hold_off_s)

    def _next(self, cursor: int) -> tuple[int | None, int]:
        """The next piece in order neither pinned nor being pinned (marked busy)."""
        n = len(self._pinned)
        with self._lock:
            while cursor < n and (self._pinned[cursor] or cursor in self._busy):
                cursor += 1
            if cursor < n:
                self._busy.add(cursor)
        return (cursor if cursor < n else None), cursor

    def run(self) -> None:
        """Pin every piece (the pinning thread's body); stops early on :meth:`stop` or
        on a failed registration (then every piece pinned so far is unpinned)."""
        t0 = time.monotonic()
        cursor = 0
        try:
            while not self._stop.is_set() and not self.failed:
                self._wait_quiet()
                i, cursor = self._next(cursor)
                if i is None:
                    break
                self._pin(i)
                time.sleep(0)  # let the engine's own threads in between
            with self._lock:  # the pieces loads are pinning
                self._settled.wait_for(lambda: not self._busy)
            if self.failed:
                self.release()
        finally:
            self.seconds = time.monotonic() - t0
            self.done.set()

    def stop(self) -> None:
        """Stop after the piece being pinned (close)."""
        self._stop.set()

    def release(self) -> None:
        """Unpin every pinned piece (pinning has stopped)."""
        for i in np.flatnonzero(self._pinned):
            self._pinned[i] = False
            try:
                self._unregister(int(i) * self.piece)
            except Exception:
                pass


class MappedPool:
    """The node's pool file mapped read-write, as a flat uint8 CPU tensor.

    Raises ``OSError`` when the file is not the one the node described (another host's
    path, a replaced file) or cannot be opened by this process.
    """

    def __init__(self, info: PoolFile, device: torch.device | None = None) -> None:
        fd = open_pool_file(info)
        try:
            self._mmap = mmap.mmap(fd, info.size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.info = info
        self.size = info.size
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.array)
        self.ptr = int(self.array.ctypes.data)
        self.piece = pin_piece(info.slab)
        """the pool is pinned in pieces of this many bytes (one registration each)"""
        self.pinner: PoolPinner | None = None
        self._register_thread: threading.Thread | None = None
        if device is not None and device.type == "cuda":
            self._start_pinning(device)

    def _start_pinning(self, device: torch.device) -> None:
        def register(off: int, n: int) -> int:
            with torch.cuda.device(device):
                err = torch.cuda.cudart().cudaHostRegister(
                    self.ptr + off, n, _REGISTER_PORTABLE_MAPPED
                )
            return int(getattr(err, "value", err))

        pinner = PoolPinner(
            self.size,
            self.piece,
            register,
            lambda off: torch.cuda.cudart().cudaHostUnregister(self.ptr + off),
            lambda off, n: _populate(self.ptr + off, n),
        )

        def pin() -> None:
            relax_capture_mode()
            try:
                pinner.run()
            except Exception as e:  # no CUDA runtime, or registration not allowed
                log.warning("PegaFlow: cannot pin the node's pool for DMA: %s", e)
                pinner.release()
                return
            if pinner.complete:
                log.info(
                    "PegaFlow: node pool %s (%.1f GiB) pinned for DMA in %.2f s",
                    self.info.path,
                    self.size / 2**30,
                    pinner.seconds,
                )

        self.pinner = pinner
        self._register_thread = threading.Thread(
            target=pin, name="pegaflow-pool-register", daemon=True
        )
        self._register_thread.start()

    @property
    def registered(self) -> bool:
        """Whether the whole mapping is pinned and visible to the device."""
        return self.pinner is not None and self.pinner.complete

    def pinned(self, offsets: Sequence[int]) -> bool:
        """Whether the blocks at ``offsets`` can be copied as pinned memory (their
        pieces not pinned yet are pinned now: :meth:`PoolPinner.pin_now`)."""
        return self.pinner is not None and self.pinner.pin_now(offsets)

    def hold_off_pinning(self) -> contextlib.AbstractContextManager[None]:
        """Around queueing copies from or to the pool: no piece is pinned meanwhile."""
        return self.pinner.hold_off() if self.pinner is not None else contextlib.nullcontext()

    def wait_registered(self, timeout: float | None = None) -> bool:
        """Wait for the background pinning; returns :attr:`registered`."""
        if self._register_thread is not None:
            self._register_thread.join(timeout)
        return self.registered

    def view(self, offset: int, size: int) -> np.ndarray:
        """Bytes ``[offset, offset + size)`` of the pool (no copy)."""
        if offset < 0 or size < 0 or offset + size > self.size:
            raise IndexError(f"pool range {offset}+{size} outside {self.size} bytes")
        return self.array[offset : offset + size]

    def close(self) -> None:
        """Unregister and unmap (the caller makes sure no copy still uses the pool)."""
        if self.pinner is not None and self._register_thread is not None:
            self.pinner.stop()
            self._register_thread.join()
            self.pinner.release()
        self.tensor = None  # type: ignore[assignment]
        self.array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process

    def __enter__(self) -> MappedPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
