"""One deadline type: how long a call (and everything it does on the way) may take.

A :class:`Deadline` is an absolute point on the monotonic clock, made once where a call
starts (from its ``timeout``, resolved against the call's default by :meth:`Deadline.of`)
and handed down as it is: to each request the call sends, across the hop from a caller's
thread to the client's event loop, to the child calls it makes (:meth:`Deadline.sub` for
a smaller budget).  Time spent queued on the way counts against it, so a call's budget is
the caller's, not each step's.
"""

from __future__ import annotations

from time import monotonic
from typing import TypeAlias

HOP_MARGIN_S = 1.0
"""How much longer than a call's deadline a thread waits for that call to come back from
another thread's event loop: the call enforces its deadline itself on the loop; this only
bounds the wait when the loop is wedged."""

MIN_WAIT_S = 0.001
"""The shortest wait :meth:`Deadline.left` hands a step, so one started at or past its
deadline still fails by itself (a timeout of 0 may mean "no timeout" to the callee)."""


class Deadline:
    """An absolute point on :func:`time.monotonic`'s clock by which a call must be done."""

    __slots__ = ("when",)

    def __init__(self, when: float) -> None:
        self.when = when
        """the deadline, in :func:`time.monotonic` seconds"""

    @classmethod
    def after(cls, timeout: float) -> Deadline:
        """The deadline ``timeout`` seconds from now."""
        return cls(monotonic() + timeout)

    @classmethod
    def of(cls, timeout: Timeout, default: float | None = None) -> Deadline:
        """The deadline of a call given ``timeout``: a :class:`Deadline` as it is (carried
        down from the caller), seconds from now, or ``None`` for ``default`` seconds.

        Raises ``TypeError`` for ``None`` without a default, ``ValueError`` for a
        negative or not-a-number timeout.
        """
        if isinstance(timeout, Deadline):
            return timeout
        if timeout is None:
            if default is None:
                raise TypeError("this call needs a timeout")
            timeout = default
        timeout = float(timeout)
        if not timeout >= 0.0:
            raise ValueError(f"a timeout must be at least 0 s, not {timeout!r}")
        return cls(monotonic() + timeout)

    def remaining(self) -> float:
        """Seconds until the deadline, 0 once it passed."""
        return max(0.0, self.when - monotonic())

    def left(self) -> float:
        """The budget of the next step: :meth:`remaining`, but at least
        :data:`MIN_WAIT_S`."""
        return max(MIN_WAIT_S, self.when - monotonic())

    @property
    def expired(self) -> bool:
        """Whether the deadline passed."""
        return monotonic() >= self.when

    def sub(self, timeout: float) -> Deadline:
        """A child budget: ``timeout`` seconds from now, or this deadline if it comes
        first (a step with a bound of its own never outlives its call)."""
        return Deadline(min(self.when, monotonic() + timeout))

    def hop_wait(self) -> float:
        """How long a thread waits for a call carrying this deadline on another thread's
        event loop: :meth:`remaining` plus :data:`HOP_MARGIN_S`."""
        return self.remaining() + HOP_MARGIN_S

    def __repr__(self) -> str:
        return f"Deadline(in {self.when - monotonic():.3f} s)"


Timeout: TypeAlias = float | Deadline | None
"""What a call's ``timeout`` takes: seconds, a :class:`Deadline` carried down from its
caller, or ``None`` for the call's default."""
