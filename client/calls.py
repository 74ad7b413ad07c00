"""The operations of the async client classes, and their blocking and future forms.

An operation is a coroutine method declared with :func:`operation`, which names the
:class:`~pegaflow.config.ClientConfig` field its ``timeout`` defaults to.  :func:`offer`
gives a synchronous facade (an :class:`OnLoop`) each operation of an async class twice,
with its signature: ``op(...)`` blocks for the answer, ``submit_op(...)`` returns a
:class:`concurrent.futures.Future` of it.  The deadline of a call is made from its
``timeout`` on the caller's thread and carried to the loop (:mod:`pegaflow.deadline`).

An operation that writes the caller's buffers (a get) names its *fetch* form, which
answers a :class:`~.data.Fetched` instead: the facade runs that one on the loop and
delivers its answer on the caller's side, so a caller that gave up on the call (a
blocking call past its deadline, a cancelled future) never has its buffers written
afterwards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pegaflow.config import ClientConfig
from pegaflow.deadline import Deadline
from pegaflow.errors import Unavailable
from pegaflow.observability import telemetry

from .data import Fetched

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Coroutine[Any, Any, Any]])

_DEFAULT = "__pegaflow_timeout__"
_FETCH = "__pegaflow_fetch__"


def operation(default: str, *, fetch: str | None = None) -> Callable[[F], F]:
    """Declare an operation whose ``timeout`` defaults to ``ClientConfig.<default>``.

    ``fetch``: the method (with the same arguments) that answers the
    :class:`~.data.Fetched` this operation delivers (see the module docstring)."""

    def register(fn: F) -> F:
        setattr(fn, _DEFAULT, default)
        if fetch is not None:
            setattr(fn, _FETCH, fetch)
        return fn

    return register


def operations(cls: type) -> dict[str, str]:
    """Each operation of ``cls`` (by name): the config field its timeout defaults to."""
    out: dict[str, str] = {}
    for name in dir(cls):
        default = getattr(getattr(cls, name), _DEFAULT, None)
        if default is not None:
            out[name] = default
    return out


def default_timeout(cfg: ClientConfig, obj: object, op: str) -> float:
    """The default timeout of operation ``op`` of ``obj``'s class."""
    return float(getattr(cfg, getattr(getattr(type(obj), op), _DEFAULT)))


class OnLoop:
    """A synchronous facade over an async object that lives on ``loop`` (a thread runs
    it); :func:`offer` adds the operations."""

    _timeouts: dict[str, str] = {}
    """each operation offered: the config field its timeout defaults to"""

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

    def _carry(
        self, op: str, pos: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Deadline, tuple[Any, ...]]:
        """The deadline of a call of ``op`` (``timeout`` at position ``pos`` of ``args``
        or in ``kwargs``), put back into its arguments in place of the timeout."""
        default = getattr(self.cfg, self._timeouts[op])
        if len(args) > pos:
            deadline = Deadline.of(args[pos], default)
            args = (*args[:pos], deadline, *args[pos + 1 :])
        else:
            deadline = kwargs["timeout"] = Deadline.of(kwargs.get("timeout"), default)
        return deadline, args


def offer(facade: type[OnLoop], target: type, attr: str) -> None:
    """Give ``facade`` every operation of ``target`` (whose instance is the facade's
    attribute ``attr``), blocking and as a future."""
    facade._timeouts = operations(target)
    for op in facade._timeouts:
        setattr(facade, op, _blocking(target, op, attr))
        setattr(facade, f"submit_{op}", _submitting(target, op, attr))


def _loop_method(target: type, op: str) -> tuple[str, bool]:
    """The method the facade runs on the loop for ``op``: ``op``, or its fetch form (then
    True: its answer is to be delivered)."""
    fetch = getattr(getattr(target, op), _FETCH, None)
    return (op, False) if fetch is None else (fetch, True)


def _blocking(target: type, op: str, attr: str) -> Callable[..., Any]:
    """``<facade>.<op>``: the target's ``op`` on the loop, waited for (a fetch form's
    answer is delivered on the caller's thread)."""
    fn = getattr(target, op)
    pos = _timeout_index(fn)
    run, fetches = _loop_method(target, op)

    @functools.wraps(fn)
    def call(self: OnLoop, *args: Any, **kwargs: Any) -> Any:
        deadline, args = self._carry(op, pos, args, kwargs)
        coro = getattr(getattr(self, attr), run)(*args, **kwargs)
        got = self._wait(self._submit(coro), deadline)
        return got.deliver() if fetches else got

    call.__doc__ = f"Blocking :meth:`{target.__name__}.{op}` (see there)."
    return call


def _submitting(target: type, op: str, attr: str) -> Callable[..., concurrent.futures.Future[Any]]:
    """``<facade>.submit_<op>``: the target's ``op`` on the loop, not waited for."""
    fn = getattr(target, op)
    pos = _timeout_index(fn)
    run, fetches = _loop_method(target, op)

    @functools.wraps(fn)
    def submit(self: OnLoop, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        _deadline, args = self._carry(op, pos, args, kwargs)
        fut = self._submit(getattr(getattr(self, attr), run)(*args, **kwargs))
        return _delivering(fut) if fetches else fut

    sig = inspect.signature(fn)
    submit.__name__ = submit.__qualname__ = f"submit_{op}"
    submit.__signature__ = sig.replace(  # type: ignore[attr-defined]
        return_annotation=f"concurrent.futures.Future[{sig.return_annotation}]"
    )
    submit.__doc__ = (
        f":meth:`{target.__name__}.{op}` without waiting: a future of its answer (its "
        "deadline runs from this call; pass a Deadline as ``timeout`` to wait for it with "
        "``fut.result(deadline.hop_wait())``)."
    )
    return submit


def _delivering(fetch: concurrent.futures.Future[Fetched]) -> concurrent.futures.Future[Any]:
    """A future of ``fetch``'s answer delivered (on the loop thread, as it comes), unless
    this future was cancelled first: the answer is then discarded.  Once its delivery
    began, ``cancel()`` says False (the caller waits for its answer)."""
    out: concurrent.futures.Future[Any] = concurrent.futures.Future()

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


def _timeout_index(fn: Callable[..., Any]) -> int:
    """Where ``timeout`` is among the positional arguments of method ``fn`` after self."""
    names = list(inspect.signature(fn).parameters)[1:]
    return names.index("timeout")
