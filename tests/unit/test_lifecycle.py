"""Unit tests of the services' shared lifecycle (pegaflow/lifecycle.py) and the kept lease
(pegaflow/etcd_lease.py KeptLease): pure logic, with a fake etcd client for the lease."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pegaflow.errors import PegaError, Unavailable
from pegaflow.etcd_lease import KeptLease
from pegaflow.lifecycle import MAX_BACKOFF_S, Backoff, Supervised, close_all


@pytest.mark.parametrize("base", [0.05, 0.1])
def test_backoff_doubles_from_the_base_up_to_the_cap(base: float) -> None:
    b = Backoff(base)
    # The formulas the mirror, the election and the publisher wrote by hand.
    for n in range(1, 60):
        assert b.failed() == min(MAX_BACKOFF_S, base * 2 ** min(n, 10))
        assert b.failures == n
    b.reset()
    assert b.failures == 0
    assert b.failed() == 2 * base


def test_backoff_stays_finite_after_very_many_failures() -> None:
    b = Backoff(0.05, cap_s=1e300)
    b.failures = 10_000  # 0.05 * 2**10000 does not fit a float
    assert b.delay() == pytest.approx(0.05 * 2**30)


@pytest.mark.parametrize(("base", "cap"), [(0.0, 5.0), (-1.0, 5.0), (2.0, 1.0)])
def test_backoff_refuses_a_base_outside_zero_to_cap(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(base, cap)


async def test_supervised_counts_errors_pauses_and_recovers() -> None:
    seen: list[Exception] = []
    outcomes: list[Any] = [ValueError("a"), Unavailable("b"), True, False, True]
    rounds = 0
    done = asyncio.Event()
    backoff = Backoff(0.001)
    failures_seen: list[int] = []

    async def one_round() -> bool:
        nonlocal rounds
        failures_seen.append(backoff.failures)
        if rounds >= len(outcomes):
            done.set()
            await asyncio.Event().wait()
        out = outcomes[rounds]
        rounds += 1
        if isinstance(out, Exception):
            raise out
        if out:
            backoff.reset()
        return out

    task = Supervised("t", one_round, on_error=seen.append, backoff=backoff)
    assert not task.running
    task.start()
    task.start()  # a started task keeps its one loop
    assert task.running
    await asyncio.wait_for(done.wait(), 5)
    assert [type(e) for e in seen] == [ValueError, Unavailable]
    # Each raise and the False round paused (one more failure); True rounds did not.
    assert failures_seen == [0, 1, 2, 0, 1, 0]
    await task.close()
    assert not task.running
    await task.close()  # closing twice is fine


async def test_supervised_finish_ends_the_loop_after_the_round() -> None:
    rounds = 0
    task: Supervised

    async def one_round() -> bool:
        nonlocal rounds
        rounds += 1
        task.finish()
        return False

    task = Supervised("t", one_round, on_error=lambda e: None, backoff=Backoff(10.0, 10.0))
    task.start()
    for _ in range(100):
        if not task.running:
            break
        await asyncio.sleep(0.01)
    assert not task.running
    assert rounds == 1
    assert task.backoff is not None and task.backoff.failures == 0  # no pause after finish
    await task.close()


async def test_close_all_cancels_every_task() -> None:
    started = 0

    async def forever() -> bool:
        nonlocal started
        started += 1
        await asyncio.Event().wait()
        return True

    tasks = [Supervised(f"t{i}", forever, on_error=lambda e: None) for i in range(3)]
    for t in tasks:
        t.start()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert started == 3 and all(t.running for t in tasks)
    await close_all(tasks)
    assert not any(t.running for t in tasks)


class _FakeLeases:
    """Answers grant/keepalive/revoke like etcd would, from a script."""

    def __init__(self) -> None:
        self.replies: list[int | PegaError] = []
        self.revoked: list[int] = []
        self.timeouts: list[float | None] = []

    async def grant(self, ttl: int, timeout: float | None = None) -> int:
        return 0x1234

    async def keepalive(self, lease_id: int, timeout: float | None = None) -> int:
        self.timeouts.append(timeout)
        r = self.replies.pop(0)
        if isinstance(r, PegaError):
            raise r
        return r

    async def revoke(self, lease_id: int, timeout: float | None = None) -> None:
        self.revoked.append(lease_id)


async def test_kept_lease_refreshes_at_a_third_of_its_ttl() -> None:
    etcd = _FakeLeases()
    t0 = time.monotonic()
    lease = await KeptLease.grant(etcd, 9)  # type: ignore[arg-type]
    assert lease.id == 0x1234
    assert lease.interval_s == 3.0
    assert t0 + 9 <= lease.valid_until <= time.monotonic() + 9
    assert 2.9 < lease.due_in() <= 3.0
    etcd.replies = [7]
    before = time.monotonic()
    assert await lease.refresh(timeout=1.5)
    assert etcd.timeouts == [1.5]
    assert before + 7 <= lease.valid_until <= time.monotonic() + 7  # the TTL etcd granted
    assert 0 < lease.left() <= 7
    etcd.replies = [0]
    assert not await lease.refresh()  # gone
    await lease.revoke()
    assert etcd.revoked == [0x1234]


async def test_kept_lease_retries_a_failed_keepalive_sooner() -> None:
    etcd = _FakeLeases()
    lease = await KeptLease.grant(etcd, 9)  # type: ignore[arg-type]
    etcd.replies = [Unavailable("down")]
    with pytest.raises(Unavailable):
        await lease.refresh()
    # A third of the time left (about 9 s), not more than the interval.
    assert 2.5 < lease.due_in() <= 3.0
    lease.valid_until = time.monotonic() - 1  # it may have expired
    lease.retry_soon()
    assert 0.0 < lease.due_in() <= 0.05  # the floor


async def test_kept_lease_with_a_retry_floor_of_its_interval() -> None:
    etcd = _FakeLeases()
    lease = await KeptLease.grant(etcd, 3, interval_s=1.0, min_retry_s=1.0)  # type: ignore[arg-type]
    lease.valid_until = time.monotonic() - 10
    etcd.replies = [Unavailable("down")]
    with pytest.raises(Unavailable):
        await lease.refresh()
    assert 0.9 < lease.due_in() <= 1.0  # the publisher's pace: every interval
