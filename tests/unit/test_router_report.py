"""When the router's reports to a coordinator fail, what it logs at WARNING: a refusal at
once, a missed deadline only once the report would lapse (TTL_INTERVALS in a row), and
each failing run once.  The coordinator's side is a stub raising the chosen errors (the
real report path: tests/integration/test_router_report.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from pegaflow.router.report import TTL_INTERVALS, Reporter

from pegaflow.errors import DeadlineExceeded, PegaError, Unauthorized, Unavailable


class _Coordinator:
    """Answers each report with the next outcome: ``None`` is an answer."""

    def __init__(self, outcomes: list[PegaError | None]) -> None:
        self.outcomes = outcomes

    async def call(self, op: Any, args: dict[str, Any], *, timeout: float) -> None:
        err = self.outcomes.pop(0)
        if err is not None:
            raise err


def _warnings(outcomes: list[PegaError | None], caplog: pytest.LogCaptureFixture) -> list[str]:
    rep = Reporter("http://r:1", ["c:1"], lambda: {}, interval_s=1.0, timeout_s=1.0)
    rep._clients["c:1"] = _Coordinator(outcomes)  # type: ignore[assignment]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pegaflow.router"):
        for _ in range(len(outcomes)):
            asyncio.run(rep.send_all(3000, 1.0))
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_missed_deadline_warns_only_once_the_report_would_lapse(
    caplog: pytest.LogCaptureFixture,
) -> None:
    late = DeadlineExceeded("no answer within 1 s")
    assert _warnings([None, late, None] + [late] * (TTL_INTERVALS - 1) + [None], caplog) == []
    warned = _warnings([late] * (TTL_INTERVALS + 4), caplog)
    assert len(warned) == 1 and f"{TTL_INTERVALS} report(s) in a row" in warned[0], warned
    gone = Unavailable("connection refused")
    assert len(_warnings([gone] * TTL_INTERVALS + [None] + [gone] * TTL_INTERVALS, caplog)) == 2


def test_a_refusal_warns_at_once_with_the_fix_and_once_per_failing_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    no = Unauthorized("bad token")
    warned = _warnings([None, no, no, no, None, no], caplog)
    assert len(warned) == 2, warned
    assert "unauthorized" in warned[0] and "--security-token-file" in warned[0], warned
