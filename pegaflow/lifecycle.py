"""The lifecycle the background services share (the index mirror, the election, the index
GC, the node's etcd publisher): one backoff policy and one supervised task.

A :class:`Supervised` task runs one *round* of its service again and again until it is
closed.  A round that raises is handed to the service's ``on_error`` (which counts and
logs it as that service's status reports it) and is followed by a pause from the
service's :class:`Backoff`; a round says by what it returns whether the next one starts at
once.  Closing cancels the task and waits for it.  The lease these services keep alive is
:class:`pegaflow.etcd_lease.KeptLease`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, InitVar, dataclass

log = logging.getLogger(__name__)

#: The longest pause of a service's retry backoff.
MAX_BACKOFF_S = 5.0
_MAX_DOUBLINGS = 30  # base * 2**30 is past any cap; keeps the float finite


class Backoff:
    """Exponential backoff: after the ``n``-th consecutive failure the pause is
    ``base_s * 2**n`` seconds, at most ``cap_s``.  :meth:`reset` on success."""

    def __init__(self, base_s: float, cap_s: float = MAX_BACKOFF_S) -> None:
        if base_s <= 0 or cap_s < base_s:
            raise ValueError(f"backoff needs 0 < base_s <= cap_s, not {base_s}, {cap_s}")
        self.base_s = base_s
        self.cap_s = cap_s
        #: Consecutive failures since the last :meth:`reset`.
        self.failures = 0

    def delay(self) -> float:
        """The pause for the failures counted so far."""
        return min(self.cap_s, self.base_s * 2 ** min(self.failures, _MAX_DOUBLINGS))

    def failed(self) -> float:
        """Count one more failure; returns the pause it calls for."""
        self.failures += 1
        return self.delay()

    def reset(self) -> None:
        """A success: the next failure pauses ``2 * base_s`` again."""
        self.failures = 0

    async def pause(self) -> None:
        """Count one more failure and sleep the pause it calls for."""
        await asyncio.sleep(self.failed())


#: One round of a service: returns True to start the next round at once, False to pause
#: (by the backoff) first.
Round = Callable[[], Awaitable[bool]]


@dataclass(eq=False, repr=False)
class Supervised:
    """A service's background task: runs ``run_round`` until closed (see the module
    docstring).

    ``name``: the asyncio task's name.  ``on_error``: called with each exception a round
    raises (not cancellation), from inside the ``except`` (so ``log.exception`` shows the
    traceback); it counts and logs as the service reports.  ``backoff``: the pause after a
    round that failed or returned False; None for no pause (the round paces itself).
    """

    name: str
    run_round: InitVar[Round]
    _: KW_ONLY
    on_error: InitVar[Callable[[Exception], None]]
    backoff: Backoff | None = None

    def __post_init__(self, run_round: Round, on_error: Callable[[Exception], None]) -> None:
        self._round = run_round
        self._on_error = on_error
        self._task: asyncio.Task[None] | None = None
        self._finished = False

    @property
    def running(self) -> bool:
        """Whether the task is started and has not ended."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the task, with its backoff reset (once: a started one keeps running)."""
        if self._task is None:
            self._finished = False
            if self.backoff is not None:
                self.backoff.reset()
            self._task = asyncio.create_task(self._loop(), name=self.name)

    def finish(self) -> None:
        """End the task after the round in progress (called from that round)."""
        self._finished = True

    def cancel(self) -> None:
        """Ask the task to end (:meth:`close` waits for it)."""
        if self._task is not None:
            self._task.cancel()

    async def close(self) -> None:
        """Cancel the task and wait until it has ended."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        while not self._finished:
            try:
                again = await self._round()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._on_error(e)
                again = False
            if not again and not self._finished and self.backoff is not None:
                await self.backoff.pause()


async def close_all(tasks: list[Supervised]) -> None:
    """Cancel all of ``tasks`` at once, then wait for each to end."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        await t.close()
