"""Polling until a condition holds: the one deadline rule of the tests.

A deadline here bounds a hang; it is not a performance assertion, so keep it generous
(the suite runs on loaded 2-core machines)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest


def _polls(what: str, timeout: float) -> Iterator[None]:
    """Yields until ``timeout`` seconds have passed, then fails the test naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        yield
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")


def wait_for(
    cond: Callable[[], object], what: str = "the condition", timeout: float = 60.0,
    interval: float = 0.05,
) -> None:  # fmt: skip
    """Polls ``cond`` until it is true; fails with ``what`` after ``timeout`` seconds."""
    for _ in _polls(what, timeout):
        if cond():
            return
        time.sleep(interval)


async def wait_until(
    cond: Callable[[], object], what: str = "the condition", timeout: float = 60.0,
    interval: float = 0.1,
) -> None:  # fmt: skip
    """:func:`wait_for` inside the event loop: ``cond`` may return a coroutine, and the
    loop runs between polls."""
    for _ in _polls(what, timeout):
        v = cond()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return
        await asyncio.sleep(interval)
