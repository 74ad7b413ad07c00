"""Forward-pass timing for the cost model."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch


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
