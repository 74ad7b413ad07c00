"""Connector policy shared by the scheduler and the worker: the circuit breaker and the
bounds of engine-start waits and of pinned locates."""

from __future__ import annotations

import time
from collections.abc import Callable

from .settings import ConnectorSettings

WARM_UP_WAIT_S = 1.0
"""longest wait of an early lookup for the engine-start connections"""
MAX_LOCATE = 4096
"""most blocks in one ``locate`` call (a node's default ``max_batch``)"""
LOCATE_PIN_S = 10.0
"""how long a ``locate`` pins its blocks; the loader unpins them when its copies are done"""


class CircuitBreaker:
    """Stops calling a failing cluster for a while, with exponential backoff.

    ``failures`` consecutive failures open the breaker for ``backoff_s``; after the
    pause one trial call is let through: a success closes the breaker, a failure
    reopens it for twice as long (capped at ``backoff_max_s``).
    """

    def __init__(
        self,
        failures: int,
        backoff_s: float,
        backoff_max_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._threshold = max(1, failures)
        self._base = backoff_s
        self._max = max(backoff_s, backoff_max_s)
        self._clock = clock
        self._fails = 0
        self._backoff = backoff_s
        self._open_until = 0.0
        self._tripped = False

    @classmethod
    def of(
        cls, settings: ConnectorSettings, clock: Callable[[], float] = time.monotonic
    ) -> CircuitBreaker:
        """A breaker with the thresholds of ``settings`` (``failures_to_backoff``,
        ``backoff_s``, ``backoff_max_s``)."""
        return cls(settings.failures_to_backoff, settings.backoff_s, settings.backoff_max_s, clock)

    def allow(self) -> bool:
        """Whether a call may be made now."""
        return self._clock() >= self._open_until

    def success(self) -> None:
        """Record a successful call (closes the breaker)."""
        self._fails = 0
        self._backoff = self._base
        self._tripped = False

    def failure(self) -> bool:
        """Record a failed call; True when this failure opened the breaker."""
        self._fails += 1
        if self._tripped or self._fails >= self._threshold:
            self._open_until = self._clock() + self._backoff
            self._backoff = min(self._backoff * 2, self._max)
            self._tripped = True
            self._fails = 0
            return True
        return False
