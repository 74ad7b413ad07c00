"""The dashboard of an idle cluster, in a headless browser: the axes of its charts read
as a scale (0, 1, 2, 3, 4), not ``1 B/s, 1 B/s, 1 B/s, 0 B/s`` (ticks of 0.25 rounded
alike).  Skipped without Debian's ``chromium``."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

import pytest

from pegaflow.tools.devcluster import Proc
from tests.support.chromium import CHROMIUM, chromium


class _Ticks(HTMLParser):
    """The text of each chart's SVG, by chart id."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: dict[str, list[str]] = {}
        self._chart: str | None = None
        self._text = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Any]]) -> None:
        a = dict(attrs)
        if tag == "svg" and str(a.get("id", "")).startswith("chart-"):
            self._chart = a["id"]
            self.charts[a["id"]] = []
        self._text = tag == "text" and self._chart is not None and "class" not in a

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._chart = None
        self._text = False

    def handle_data(self, data: str) -> None:
        if self._text and self._chart is not None:
            self.charts[self._chart].append(data)


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium absent: apt-get install chromium")
def test_an_idle_charts_axis_is_a_scale(server: Proc) -> None:
    page = _Ticks()
    page.feed(chromium(f"http://127.0.0.1:{server.ready['http']}/", "--dump-dom"))
    for chart, unit in (("chart-throughput", " B/s"), ("chart-lookups", "")):
        ticks = [t for t in page.charts[chart] if ":" not in t][:5]  # not the clock's
        assert ticks == [f"{v}{unit}" for v in range(5)], (chart, page.charts[chart])
