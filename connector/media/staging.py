"""Host staging memory of the remote medium: a bounded pool of reusable buffers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from pegaflow.deadline import Deadline

from .kvio import KVBlockIO

Buf = tuple[torch.Tensor, Any]
"""a staging buffer: its tensor and the client's registered memory of it"""


class Staging:
    """A bounded pool of reusable host buffers of ``chunk_blocks`` blocks each."""

    def __init__(
        self, io: KVBlockIO, chunk_blocks: int, max_bytes: int, min_chunks: int = 1
    ) -> None:
        self.io = io
        self.chunk_blocks = chunk_blocks
        self.max_chunks = max(min_chunks, max_bytes // max(1, chunk_blocks * io.block_bytes))
        self.max_bytes = self.max_chunks * chunk_blocks * io.block_bytes
        self._free: list[Buf] = []
        self._held: list[tuple[Buf, Callable[[], bool]]] = []
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

    def acquire(self, wait: bool, timeout: float = 0.0) -> Buf | None:
        """A buffer; ``None`` when none is free (after ``timeout`` if ``wait``)."""
        deadline = Deadline.after(timeout)
        with self._cond:
            while True:
                self._reclaim()
                if self._free:
                    return self._free.pop()
                if self._made < self.max_chunks:
                    self._made += 1
                    break
                if not wait or deadline.expired:
                    return None
                self._cond.wait(deadline.remaining())
        try:
            return self.io.new_staging(self.chunk_blocks)
        except Exception:
            with self._cond:
                self._made -= 1
            raise

    def release(self, buf: Buf, ready: Callable[[], bool] | None = None) -> None:
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
