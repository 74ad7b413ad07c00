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
import functools
import inspect
from collections.abc import Callable, Coroutine
from types import MethodType
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

from pegaflow.config import ClientConfig
from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import Unavailable
from pegaflow.observability import telemetry

from .data import GetOptions
from .landing import Fetched

T = TypeVar("T")
S = TypeVar("S")
R = TypeVar("R")
A = TypeVar("A")
P = ParamSpec("P")
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

    Each operation of the facade is declared from the async one (:class:`blocking`,
    :class:`submitted`), or written out where it does more, and goes through
    :meth:`_start`: its deadline is made on the caller's thread, then the async
    operation of :attr:`_target` runs on the loop with it."""

    _target: Any
    """the async object whose operations the facade runs (set by the subclass)"""

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


class _Op(Generic[S, P, R, A]):
    """An operation of a facade, declared at class level from the async method ``op``
    (``lookup = blocking(PegaClient.lookup)``): it has ``op``'s signature, and a call
    runs ``op`` of the facade's :attr:`OnLoop._target` through :meth:`OnLoop._start` and
    answers ``A`` (``op``'s answer ``R``, or a future of it)."""

    def __init__(self, op: Callable[Concatenate[S, P], Coroutine[Any, Any, R]]) -> None:
        functools.update_wrapper(self, op)  # its name, and its signature for inspect
        self._name = op.__name__
        params = list(inspect.signature(op).parameters)[1:]
        self._at = params.index("timeout")
        self._after = params[self._at + 1 :]

    @overload
    def __get__(self, facade: None, owner: type) -> Self: ...
    @overload
    def __get__(self, facade: OnLoop, owner: type) -> Callable[P, A]: ...
    def __get__(self, facade: OnLoop | None, owner: type) -> Any:
        return self if facade is None else MethodType(self, facade)

    def _begin(
        self, facade: OnLoop, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[concurrent.futures.Future[R], Deadline]:
        timeout, args = self._split(args, kwargs)
        return facade._start(getattr(facade._target, self._name), timeout, *args, **kwargs)

    def _split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Timeout, tuple[Any, ...]]:
        """The call's ``timeout``, and its arguments before it (those after it are moved
        into ``kwargs``, by name)."""
        if len(args) <= self._at:
            return kwargs.pop("timeout", None), args
        kwargs.update(zip(self._after, args[self._at + 1 :], strict=False))
        return args[self._at], args[: self._at]


class blocking(_Op[S, P, R, R]):
    """The blocking form of an operation: waits for its answer."""

    def __call__(self, facade: OnLoop, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return facade._wait(*self._begin(facade, args, kwargs))


class submitted(_Op[S, P, R, concurrent.futures.Future[R]]):
    """The ``submit_`` form of an operation: a future of its answer, at once."""

    def __call__(
        self, facade: OnLoop, /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[R]:
        return self._begin(facade, args, kwargs)[0]


class _Get(_Op[S, P, R, A]):
    """A get of a facade, declared from the async get ``op`` and its *fetch* form
    ``fetch`` (``op``'s arguments, but the generations and ``zero_copy`` as one
    :class:`~.data.GetOptions`, answering a :class:`~.landing.Fetched`): the facade
    runs the fetch and writes the caller's buffers on its side (module docstring)."""

    def __init__(
        self,
        op: Callable[Concatenate[S, P], Coroutine[Any, Any, R]],
        fetch: Callable[..., Coroutine[Any, Any, Fetched]],
    ) -> None:
        super().__init__(op)
        self._fetch = fetch.__name__

    def _fetching(
        self, facade: OnLoop, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[concurrent.futures.Future[Fetched], Deadline]:
        timeout, args = self._split(args, kwargs)
        opts = GetOptions(kwargs.pop(self._after[0], None), kwargs.pop("zero_copy", False))
        target = facade._target
        get, fetch = getattr(target, self._name), getattr(target, self._fetch)
        return facade._start(get, timeout, *args, opts, via=fetch)


class blocking_get(_Get[S, P, R, R]):
    """The blocking form of a get: the blocks are copied into the caller's buffers on
    the caller's thread, and never once the call gave up."""

    def __call__(self, facade: OnLoop, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return facade._wait(*self._fetching(facade, args, kwargs)).deliver()  # type: ignore[return-value]


class submitted_get(_Get[S, P, R, concurrent.futures.Future[R]]):
    """The ``submit_`` form of a get: a future of its answer, whose blocks are copied
    into the buffers as it comes, unless the future was cancelled first
    (:func:`delivering`).  Its deadline runs from this call; pass a Deadline as
    ``timeout`` to wait for it with ``fut.result(deadline.hop_wait())``."""

    def __call__(
        self, facade: OnLoop, /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[R]:
        return delivering(self._fetching(facade, args, kwargs)[0])  # type: ignore[return-value]


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
