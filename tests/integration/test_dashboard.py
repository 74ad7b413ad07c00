"""The coordinator's dashboard (``/`` and ``/v1/dashboard``) against a real
``pegaflow-server`` with real traffic, rendered by headless Chromium.

The Chromium part is skipped when Debian's ``chromium`` is not installed
(``apt-get install -y chromium``); the JSON checks run regardless.  The screenshot
replaces ``docs/dashboard.png`` (for the README) when PEGAFLOW_UPDATE_SCREENSHOT=1.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pegaflow.client import PegaClient

from pegaflow.config import ClientConfig
from pegaflow.tools.dashboard import Dashboard, parse_metrics_text
from pegaflow.tools.devcluster import Proc, free_port, start_server
from tests.support.chromium import CHROMIUM, chromium

pytestmark = pytest.mark.ucx

REPO = Path(__file__).resolve().parents[2]
NODE = "dash-node"
NS = "dash-model"
BLOCK = 256 << 10
ROUNDS = 3
PER_ROUND = 12  # blocks stored per round
MISSES = 6  # unknown hashes asked for per round
GETS = 2  # reads of each round's blocks


def http_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    shm_dir = tempfile.mkdtemp(prefix="pegaflow-dash-", dir="/dev/shm")
    proc = start_server(
        extra=[
            "--node-id", NODE,
            "--node-pool-bytes", "128MiB",
            "--node-slab-bytes", "8MiB",
            "--node-shm-dir", shm_dir,
        ]
    )  # fmt: skip
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{proc.ready['http']}/v1/dashboard", timeout=10)
    except urllib.error.HTTPError as e:
        proc.terminate()
        shutil.rmtree(shm_dir, ignore_errors=True)
        pytest.fail(
            f"/v1/dashboard answered {e.code}: the coordinator must install the dashboard "
            "(coordinator/service.py: start_http(..., app_hook=dashboard.app_hook(...)))"
        )
    yield proc
    proc.terminate()
    shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def traffic(server: Proc) -> dict[str, Any]:
    """Open the dashboard, then run ROUNDS rounds of put / lookup / get, each followed
    by a dashboard sample; returns what was done and the dashboard document after."""
    http = int(server.ready["http"])
    first = http_json(http, "/v1/dashboard")  # starts the sampler
    assert first["history"], "the first poll takes a sample"
    t_start = time.time()

    async def run() -> None:
        cfg = ClientConfig(coordinators=[server.ready["coordinator"]], lookup_timeout_s=5.0)
        client = PegaClient(cfg)
        rng = np.random.default_rng(7)
        try:
            for _ in range(ROUNDS):
                hashes = [os.urandom(32) for _ in range(PER_ROUND)]
                data = rng.integers(0, 255, size=(PER_ROUND, BLOCK), dtype=np.uint8)
                put = await client.put_blocks(
                    NS, [(h, 0, data[i]) for i, h in enumerate(hashes)], node_id=NODE
                )
                assert put.stored == PER_ROUND
                res = await client.lookup(NS, hashes + [os.urandom(32) for _ in range(MISSES)])
                assert res.hits == PER_ROUND
                out = np.zeros_like(data)
                for _ in range(GETS):
                    ok = await client.get_blocks(
                        NS, [(res.blocks[i][0], h, 0, out[i]) for i, h in enumerate(hashes)]
                    )
                    assert all(ok) and np.array_equal(out, data)
                await wait_sample_after(http, time.time())
        finally:
            await client.close()

    asyncio.run(run())
    # the node's usage gauges follow a commit within about a second
    deadline = time.monotonic() + 60
    while True:
        doc = http_json(http, "/v1/dashboard")
        if doc["cluster"]["used_bytes"] >= ROUNDS * PER_ROUND * BLOCK:
            break
        assert time.monotonic() < deadline, "pool usage never reached the dashboard"
        time.sleep(0.2)
    return {"http": http, "t_start": t_start, "doc": doc, "first": first}


async def wait_sample_after(http: int, t: float, timeout: float = 60.0) -> None:
    """Wait until the dashboard has a history point newer than ``t``."""
    deadline = time.monotonic() + timeout
    while not (await asyncio.to_thread(http_json, http, f"/v1/dashboard?since={t}"))["history"]:
        assert time.monotonic() < deadline, "the dashboard sampler took no new sample"
        await asyncio.sleep(0.1)


# ---- the JSON document ---------------------------------------------------------------


def test_page_is_self_contained(server: Proc) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ready['http']}/", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/html")
        page = r.read().decode()
    assert "/v1/dashboard" in page
    # nothing fetched from anywhere but this coordinator: no external scripts, styles, fonts
    for bad in ("<script src", "<link", "@import", "url(", "https://", "cdn"):
        assert bad not in page, f"the dashboard must not load {bad!r}"


def test_dashboard_document_counts_the_traffic(traffic: dict[str, Any]) -> None:
    doc = traffic["doc"]
    c = doc["cluster"]
    stored = ROUNDS * PER_ROUND
    assert c["nodes"] == c["nodes_ok"] == 1
    assert c["index_blocks"] == stored
    assert c["hit_blocks"] == stored
    assert c["miss_blocks"] == ROUNDS * MISSES
    assert c["lookups"] == ROUNDS
    assert c["hit_rate"] == pytest.approx(PER_ROUND / (PER_ROUND + MISSES))
    assert c["capacity_bytes"] == 128 << 20
    (node,) = doc["nodes"]
    assert node["node_id"] == NODE and node["health"] == "ok"
    assert node["blocks"] == stored and node["entries"] == stored
    assert node["get_bytes"] == stored * GETS * BLOCK
    assert node["put_bytes"] == stored * BLOCK
    assert node["errors"] == 0


def test_history_rates_add_up_to_the_bytes_moved(traffic: dict[str, Any]) -> None:
    """The throughput series integrates to exactly the bytes the traffic moved, and the
    hit-rate series shows the per-interval hit rate."""
    http = traffic["http"]
    hist = http_json(http, "/v1/dashboard")["history"]
    before = [p for p in hist if p["t"] <= traffic["t_start"]]
    assert before, "a sample was taken before the traffic"
    pts = [before[-1]] + [p for p in hist if p["t"] > traffic["t_start"]]
    got = put = 0.0
    for prev, cur in itertools.pairwise(pts):
        got += (cur["get_bps"] or 0.0) * (cur["t"] - prev["t"])
        put += (cur["put_bps"] or 0.0) * (cur["t"] - prev["t"])
    stored = ROUNDS * PER_ROUND
    assert got == pytest.approx(stored * GETS * BLOCK, rel=2e-3)
    assert put == pytest.approx(stored * BLOCK, rel=2e-3)
    rates = [p["hit_rate"] for p in pts if p["hit_rate"] is not None]
    assert rates and all(r == pytest.approx(PER_ROUND / (PER_ROUND + MISSES)) for r in rates)


async def test_unreachable_node_is_shown_as_such() -> None:
    """A node whose HTTP endpoint does not answer is listed as unreachable, with why."""
    port = free_port()  # nothing listens there
    node = {"node_id": "ghost", "host": "127.0.0.1", "ucx_port": 1, "http": f"127.0.0.1:{port}",
            "capacity_bytes": 1 << 30, "used_bytes": 0, "blocks": 0}  # fmt: skip

    async def status() -> dict[str, Any]:
        return {"nodes": [node], "blocks": 0, "coordinator": {"id": "t"}}

    dash = Dashboard(status, None, scrape_timeout_s=2.0)
    try:
        await dash.sample()
        doc = dash.snapshot()
    finally:
        await dash.close()
    (n,) = doc["nodes"]
    assert n["health"] == "unreachable" and n["error"]
    assert doc["cluster"]["nodes_ok"] == 0 and doc["cluster"]["capacity_bytes"] == 1 << 30


def test_metrics_text_parsing() -> None:
    text = (
        "# TYPE pegaflow_node_get_bytes counter\n"
        "pegaflow_node_get_bytes_total 1024.0\n"
        "# TYPE pegaflow_node_transfer_errors counter\n"
        'pegaflow_node_transfer_errors_total{kind="timeout"} 2.0\n'
        'pegaflow_node_transfer_errors_total{kind="closed"} 3.0\n'
    )
    v = parse_metrics_text(text, {"pegaflow_node_get_bytes_total": "get",
                                  "pegaflow_node_transfer_errors_total": "err"})  # fmt: skip
    assert v == {"get": 1024.0, "err": 5.0}


# ---- in a browser ----------------------------------------------------------------------


class _Dom(HTMLParser):
    """Every element's attributes, by id and by data-node / data-series."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict[str, str]] = {}
        self.nodes: dict[str, dict[str, str]] = {}
        self.series: dict[str, dict[str, str]] = {}
        self.body: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.by_id[a["id"]] = a
        if "data-node" in a:
            self.nodes[a["data-node"]] = a
        if "data-series" in a:
            self.series[a["data-series"]] = a
        if tag == "body":
            self.body = a


@pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium absent: apt-get install -y chromium"
)
def test_browser_shows_the_cluster(traffic: dict[str, Any]) -> None:
    url = f"http://127.0.0.1:{traffic['http']}/"
    dom = _Dom()
    dom.feed(chromium(url, "--dump-dom"))
    assert dom.body.get("data-loaded") == "1", "the page never rendered a poll"
    ids = dom.by_id
    stored = ROUNDS * PER_ROUND
    assert ids["kpi-nodes"]["data-value"] == "1"
    assert float(ids["kpi-blocks"]["data-value"]) == stored
    assert float(ids["kpi-hit-rate"]["data-value"]) == pytest.approx(
        PER_ROUND / (PER_ROUND + MISSES)
    )
    assert float(ids["kpi-usage"]["data-value"]) == pytest.approx(
        stored * BLOCK / (128 << 20), rel=0.05
    )
    row = dom.nodes[NODE]
    assert row["data-health"] == "ok"
    assert float(row["data-blocks"]) == stored
    assert float(row["data-capacity"]) == 128 << 20
    # the charts are drawn: a line for each series, with the sampled points
    for name in ("hit_rate", "get", "put", "used", "capacity", "lookups"):
        assert name in dom.series, f"chart series {name!r} not drawn"
    assert int(dom.series["get"]["data-points"]) >= ROUNDS
    assert int(dom.series["hit_rate"]["data-points"]) >= 1


@pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium absent: apt-get install -y chromium"
)
def test_screenshot(traffic: dict[str, Any]) -> None:
    """A real rendering of the page; with PEGAFLOW_UPDATE_SCREENSHOT=1 it replaces
    docs/dashboard.png (the README's picture), otherwise the tree is left alone."""
    shot = REPO / "docs" / "dashboard.png"
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d) / "dashboard.png"
        chromium(f"http://127.0.0.1:{traffic['http']}/", f"--screenshot={tmp}")
        data = tmp.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
        if os.environ.get("PEGAFLOW_UPDATE_SCREENSHOT") == "1":
            shutil.copyfile(tmp, shot)


def test_cli_status(traffic: dict[str, Any], server: Proc) -> None:
    """``pegaflow status``: the node with its health and usage, and the hit rate."""
    out = subprocess.run(
        [sys.executable, "-m", "pegaflow.tools.cli", "status", "--coordinators",
         server.ready["coordinator"]],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["NODE", "ADDRESS", "HEALTH"]
    row = next(line for line in lines if line.startswith(NODE)).split()
    assert row[2] == "ok"
    assert f"{ROUNDS * PER_ROUND}" in row
    hits = ROUNDS * PER_ROUND
    assert f"lookup hit rate 66.7% ({hits} of {hits + ROUNDS * MISSES} blocks" in out.stdout
    assert "health: all nodes ok" in out.stdout
