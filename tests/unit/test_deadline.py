"""The deadline type (pure logic, on a patched clock) and the sync client carrying it
across the hop to its event loop (a real client, no network: its coordinator calls are
answered in process)."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pegaflow.client import PegaClient, SyncPegaClient

from pegaflow import deadline as dl
from pegaflow.config import ClientConfig
from pegaflow.deadline import HOP_MARGIN_S, MIN_WAIT_S, Deadline
from pegaflow.errors import Unavailable


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(dl, "monotonic", c)
    return c


def test_a_timeout_resolves_against_the_default_only_when_none(clock: Clock) -> None:
    assert Deadline.of(2.0, 9.0).when == 102.0
    assert Deadline.of(None, 9.0).when == 109.0
    assert Deadline.of(0, 9.0).when == 100.0  # 0 is a timeout, not "use the default"
    with pytest.raises(TypeError):
        Deadline.of(None)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError):
            Deadline.of(bad, 1.0)


def test_a_deadline_is_carried_down_as_it_is(clock: Clock) -> None:
    d = Deadline.after(1.0)
    clock.t += 0.4  # queued on the way to the loop: the time counts
    assert Deadline.of(d, 30.0) is d
    assert d.remaining() == pytest.approx(0.6)


def test_remaining_left_and_expired(clock: Clock) -> None:
    d = Deadline.after(0.5)
    assert not d.expired and d.remaining() == 0.5 and d.left() == 0.5
    clock.t += 0.5
    assert d.expired and d.remaining() == 0.0
    assert d.left() == MIN_WAIT_S  # a step started at the deadline still fails by itself
    clock.t += 3
    assert d.remaining() == 0.0 and d.left() == MIN_WAIT_S


def test_a_child_budget_never_outlives_its_parent(clock: Clock) -> None:
    d = Deadline.after(2.0)
    assert d.sub(0.5).when == 100.5
    assert d.sub(5.0).when == d.when
    clock.t += 1.8
    assert d.sub(1.0).when == d.when


def test_the_hop_waits_the_margin_past_the_deadline(clock: Clock) -> None:
    d = Deadline.after(2.0)
    assert d.hop_wait() == 2.0 + HOP_MARGIN_S
    clock.t += 10
    assert d.hop_wait() == HOP_MARGIN_S


# ---- the sync client carries the deadline across the hop to its loop ------------------


def _ops() -> list[str]:
    """The operations of the async client (its public coroutine methods)."""
    return [
        name
        for name, fn in inspect.getmembers(PegaClient, inspect.iscoroutinefunction)
        if not name.startswith("_") and name != "close"
    ]


def test_the_sync_client_offers_every_operation_blocking_and_as_a_future() -> None:
    ops = _ops()
    assert {"lookup", "locate", "unpin", "reserve_local", "commit_local"} <= set(ops)
    for name in ops:
        blocking, submit = getattr(SyncPegaClient, name), getattr(SyncPegaClient, f"submit_{name}")
        params = list(inspect.signature(getattr(PegaClient, name)).parameters)
        assert list(inspect.signature(blocking).parameters) == params
        assert list(inspect.signature(submit).parameters) == params
    # no lambdas to pass, nothing to probe for
    assert not hasattr(SyncPegaClient, "call") and not hasattr(SyncPegaClient, "submit")


def test_each_operation_resolves_its_own_default() -> None:
    for name in _ops():
        # the default the sync wrapper waits by is the one the operation uses
        assert f'self._deadline("{name}", timeout)' in inspect.getsource(getattr(PegaClient, name))


@pytest.fixture
def wedged() -> Iterator[tuple[SyncPegaClient, threading.Event, list[Any]]]:
    """A client whose loop is held up until the event is set; its coordinator calls are
    recorded (their ``timeout``) and answered "no hits" without a network."""
    c = SyncPegaClient(ClientConfig(coordinators=["127.0.0.1:9"]))
    seen: list[Any] = []

    async def call(op: str, args: Any = None, timeout: Any = None) -> Any:
        seen.append(timeout)
        return {"hits": 0}

    c._client._rpc.call = call  # type: ignore[method-assign]
    release = threading.Event()

    async def hold() -> None:
        release.wait(30)  # blocks the loop thread itself, as a wedged loop would

    try:
        c._submit(hold())
        yield c, release, seen
    finally:
        release.set()
        c.close()


def test_the_deadline_is_made_when_the_caller_calls_not_when_the_loop_gets_to_it(
    wedged: tuple[SyncPegaClient, threading.Event, list[Any]],
) -> None:
    c, release, seen = wedged
    fut = c.submit_lookup("ns", [bytes(32)], timeout=0.5)
    submitted = time.monotonic()
    release.set()
    assert fut.result(10).hits == 0
    (got,) = seen
    assert isinstance(got, Deadline) and got.when <= submitted + 0.5
    mine = Deadline.after(30.0)
    assert c.lookup("ns", [bytes(32)], (0,), mine).hits == 0  # positional: carried as is
    assert seen[1] is mine


def test_a_wedged_loop_fails_a_blocking_call_past_its_deadline(
    wedged: tuple[SyncPegaClient, threading.Event, list[Any]],
) -> None:
    c, _release, seen = wedged
    with pytest.raises(Unavailable, match="did not answer"):
        c.lookup("ns", [bytes(32)], timeout=0.0)  # waits HOP_MARGIN_S, then gives up
    assert not seen
