"""A call's deadline, and the way a blocking facade runs an async operation.

An operation is a coroutine method declared with :func:`operation`, which names the
:class:`~pegaflow.config.ClientConfig` field its ``timeout`` defaults to.
:func:`deadline_of` is the one place a call's ``timeout`` becomes its
:class:`~pegaflow.deadline.Deadline`: the async operations resolve it there, and so
does a blocking facade (:class:`OnLoop`) on the caller's thread before it hands the
call to the loop, so the wait for the loop counts against the call's budget.

A get writes the caller's buffers: a facade runs its *fetch* form, which answers a
:class:`~.landing.Fetched`, and delivers it on the caller's side (:func:`delivering` for
a future), so a caller that gave up on the call (a blocking call past its deadline, a
cancelled future) never has its buffers written afterwards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pegaflow.config import ClientConfig
from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import Unavailable
from pegaflow.observability import telemetry

from .landing import Fetched

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Coroutine[Any, Any, Any]])

_DEFAULT = "__pegaflow_timeout__"


def operation(default: str) -> Callable[[F], F]:
    """Declare an operation whose ``timeout`` defaults to ``ClientConfig.<default>``."""

    def register(fn: F) -> F:
        setattr(fn, _DEFAULT, default)
        return fn

    return register


def deadline_of(cfg: ClientConfig | None, op: Callable[..., Any], timeout: Timeout) -> Deadline:
    """The deadline of a call of operation ``op`` given its ``timeout``: a
    :class:`Deadline` as it is (carried down), else seconds from now, ``None`` for the
    default :func:`operation` declared for ``op`` (none without a ``cfg``: the call then
    needs a timeout)."""
    if isinstance(timeout, Deadline):
        return timeout
    default = None if cfg is None else float(getattr(cfg, getattr(op, _DEFAULT)))
    return Deadline.of(timeout, default)


class OnLoop:
    """A blocking facade over an async object that lives on ``loop`` (a thread runs it).

    Each operation of the facade is written out and goes through :meth:`_start`: its
    deadline is made on the caller's thread, then the async operation runs on the loop
    with it."""

    def __init__(self, cfg: ClientConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.cfg = cfg
        self._loop = loop

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        # bind_context: the caller's trace context follows the call onto the loop thread
        return asyncio.run_coroutine_threadsafe(telemetry.bind_context(coro), self._loop)

    def _wait(self, fut: concurrent.futures.Future[T], deadline: Deadline) -> T:
        try:
            # the coroutine enforces the deadline itself; this only guards a wedged loop
            return fut.result(deadline.hop_wait())
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise Unavailable("client event loop did not answer in time") from None

    def _start(
        self,
        op: Callable[..., Coroutine[Any, Any, Any]],
        timeout: Timeout,
        *args: Any,
        via: Callable[..., Coroutine[Any, Any, Any]] | None = None,
        **kwargs: Any,
    ) -> tuple[concurrent.futures.Future[Any], Deadline]:
        """``op(*args, timeout=<deadline>, **kwargs)`` started on the loop (or ``via``
        with those arguments: ``op``'s fetch form), and that deadline (made here, from
        ``timeout`` and ``op``'s default: :func:`deadline_of`)."""
        deadline = deadline_of(self.cfg, op, timeout)
        run = op if via is None else via
        return self._submit(run(*args, timeout=deadline, **kwargs)), deadline

    def _call(
        self, op: Callable[..., Coroutine[Any, Any, T]], timeout: Timeout, *args: Any, **kwargs: Any
    ) -> T:
        """:meth:`_start`, waited for."""
        return self._wait(*self._start(op, timeout, *args, **kwargs))

    def _later(
        self, op: Callable[..., Coroutine[Any, Any, T]], timeout: Timeout, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """:meth:`_start`, not waited for: the future of its answer."""
        return self._start(op, timeout, *args, **kwargs)[0]


def delivering(fetch: concurrent.futures.Future[Fetched]) -> concurrent.futures.Future[list[bool]]:
    """A future of ``fetch``'s answer delivered (on the loop thread, as it comes), unless
    this future was cancelled first: the answer is then discarded.  Once its delivery
    began, ``cancel()`` says False (the caller waits for its answer)."""
    out: concurrent.futures.Future[list[bool]] = concurrent.futures.Future()

    def done(f: concurrent.futures.Future[Fetched]) -> None:
        if f.cancelled():
            out.cancel()
            return
        if not out.set_running_or_notify_cancel():  # the caller gave up first
            if f.exception() is None:
                f.result().discard()
            return
        try:
            out.set_result(f.result().deliver())  # result() raises the fetch's error
        except BaseException as e:
            out.set_exception(e)

    def given_up(o: concurrent.futures.Future[Any]) -> None:
        if o.cancelled():
            fetch.cancel()

    fetch.add_done_callback(done)
    out.add_done_callback(given_up)
    return out
