"""An event loop on a thread of its own, for a component that must not wait behind the
work of another one in the same process.

``pegaflow-server`` runs its coordinator on one: lookups are then answered by their own
loop while the node's loop is busy with bulk transfers (UCX progress, slot copies,
hashing hand-offs), instead of queueing behind them on one shared loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")

_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 10.0


class LoopThread:
    """A uvloop event loop running on a daemon thread named ``name``.

    :meth:`run` awaits a coroutine on it from another loop; :meth:`call` queues a plain
    function on it from any thread.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread and wait until its loop runs."""
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            raise RuntimeError(f"event loop thread {self.name} did not start")

    def _main(self) -> None:
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        self.loop = loop
        loop.call_soon(self._ready.set)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this thread's loop; the caller's loop awaits its result."""
        assert self.loop is not None, "start() first"
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` on this thread's loop (from any thread)."""
        assert self.loop is not None, "start() first"
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        """Stop the loop once what is queued has run, and wait for the thread."""
        if self.loop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(_STOP_TIMEOUT_S)
