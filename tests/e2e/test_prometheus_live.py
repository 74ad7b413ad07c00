"""A real Prometheus (Debian's ``prometheus``) over real PegaFlow processes: the scrape
configuration of ``configs/prometheus.yml`` (its job names, targets pointed at the
processes of this test), its alert rules (``configs/prometheus-alerts.yml``) loaded
and evaluated, and every query of the Grafana dashboard and every alert expression
checked against what Prometheus really scraped (its HTTP API): each metric it names is
exposed by a target, and each expression selects at least one series that exists.

* The fast test runs one ``pegaflow-server`` (with etcd, so that the etcd series
  exist too), scraped under the coordinator, node and single-host jobs, and checks
  every expression that does not need an engine; the zero-target (``absent``) and
  single-host-down alerts are evaluated and must fire.
* The slow test adds a real vLLM OpenAI server (``vllm serve``) with the connector,
  sends it a cold and a warm request, and checks the rest: the connector's
  ``vllm:pegaflow_*`` counters and latency histograms on the engine's ``/metrics``.

The only waits are bounded waits for the first scrape and rule evaluation.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pegaflow.tools.devcluster import EtcdServer, Proc, free_port, start_server

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
ALERTS = CONFIGS / "prometheus-alerts.yml"
DASHBOARD = CONFIGS / "grafana" / "pegaflow-dashboard.json"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
NO_PROMETHEUS = (
    "Debian's prometheus package is not installed (no prometheus/promtool binary): "
    "scripts/setup.sh installs it (apt-get install prometheus)"
)
BLOCK = 64 << 10
NS = "prom-live"
#: job of configs/prometheus.yml scraping vLLM engines
ENGINE_JOB = "vllm"

#: labelled counters whose series appear with their first increment, which this test
#: cannot cause on purpose: an expression naming only these is checked for the metric
#: being exposed (its ``# TYPE`` line reached Prometheus), not for a series
NO_SERIES_UNTIL_FIRST = {
    "pegaflow_node_transfer_errors_total": "a UCX transfer failing (peer gone mid-send)",
}

needs_prometheus = pytest.mark.skipif(
    not (os.access(PROMETHEUS, os.X_OK) and os.access(PROMTOOL, os.X_OK)), reason=NO_PROMETHEUS
)

# -- PromQL: the series an expression selects -------------------------------------------

_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\{[^}]*\})?')
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan", "by", "without"}


def selectors(expr: str) -> list[str]:
    """The series selectors of a PromQL expression (``name`` or ``name{labels}``):
    function and aggregation names, grouping labels, ranges and Grafana variables
    are left out."""
    e = re.sub(r"\[[^\]]*\]", "", expr)  # ranges, subqueries, $__rate_interval
    e = _GROUPING.sub(" ", e)
    out: list[str] = []
    for m in _TOKEN.finditer(e):
        name = m.group(1)
        if name is None or name.lower() in _KEYWORDS:
            continue
        labels = m.group(2)
        if not labels and e[m.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        out.append(name + (labels or "").strip())
    return out


def metric_name(selector: str) -> str:
    return selector.split("{", 1)[0].strip()


def test_selectors_parse_promql() -> None:
    """The parser the live checks rely on (pure logic)."""
    e = (
        'histogram_quantile(0.99, sum by (le, op) (rate(a_bucket{job="x", le!=""}'
        "[$__rate_interval]))) / clamp_min(sum(rate(vllm:b_total[5m] offset 1d)), 1e-9)"
        ' > 0.5 and absent(up{job=~"p|q"}) or c == bool 1'
    )
    assert selectors(e) == [
        'a_bucket{job="x", le!=""}',
        "vllm:b_total",
        'up{job=~"p|q"}',
        "c",
    ]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the Grafana dashboard."""
    out: list[tuple[str, str]] = []

    def walk(panel: dict[str, Any]) -> None:
        for t in panel.get("targets", []):
            out.append((f"panel {panel.get('title')!r}", t["expr"]))
        for p in panel.get("panels", []):
            walk(p)

    for p in json.loads(DASHBOARD.read_text())["panels"]:
        walk(p)
    return out


def alert_rules() -> list[tuple[str, str]]:
    """(alert name, expression) of every rule of the alerts file."""
    doc = yaml.safe_load(ALERTS.read_text())
    return [
        (f"alert {r.get('alert') or r.get('record')}", r["expr"])
        for g in doc["groups"]
        for r in g["rules"]
    ]


def alert_expr(name: str) -> str:
    found = [e for n, e in alert_rules() if n == f"alert {name}"]
    assert found, f"{ALERTS.name} has no alert {name}"
    return found[0]


def needs_engine(expr: str) -> bool:
    """True when the expression reads an engine's series (the slow test's part)."""
    return any(
        metric_name(s).startswith("vllm:") or f'job="{ENGINE_JOB}"' in s for s in selectors(expr)
    )


# -- a real Prometheus --------------------------------------------------------------------


class Prometheus:
    """``prometheus`` on a free loopback port, scraping every second."""

    def __init__(self, workdir: Path, targets: dict[str, list[str]]) -> None:
        base = yaml.safe_load((CONFIGS / "prometheus.yml").read_text())
        jobs = [j["job_name"] for j in base["scrape_configs"]]
        assert set(targets) - {"pegaflow-server"} <= set(jobs), (
            f"jobs {sorted(set(targets) - set(jobs))} not in configs/prometheus.yml"
        )
        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(CONFIGS / f) for f in base["rule_files"]],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": hosts}]}
                for job, hosts in targets.items()
            ],
        }
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(cfg))
        check = subprocess.run(
            [PROMTOOL, "check", "config", str(self.config)], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.wait(lambda: self._ready(), "Prometheus to be ready", 60)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def wait(self, cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        """Until ``cond()`` holds; fails after ``timeout`` seconds (a bound, not a timing)."""
        deadline = time.monotonic() + timeout
        while not cond():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}; Prometheus log:\n{self.tail()}")
            time.sleep(0.2)

    def tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``'s ``data`` (asserts the call succeeded)."""
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of ``expr`` now."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def series(self, selector: str) -> list[dict[str, str]]:
        """The series matching ``selector`` seen in the last hour."""
        start = str(time.time() - 3600)
        return list(self.api("series", **{"match[]": selector, "start": start}))

    def metadata_names(self) -> set[str]:
        """Metric names the scraped targets expose (their ``# TYPE`` lines), samples
        or not (a labelled counter has no series before its first increment)."""
        return set(self.api("metadata"))

    def scraped(self, job: str, up: float = 1.0) -> bool:
        return bool(self.query(f'up{{job="{job}"}} == {up}'))

    def rules_evaluated(self) -> bool:
        rules = [r for g in self.api("rules")["groups"] for r in g["rules"]]
        return bool(rules) and all(r.get("health") != "unknown" for r in rules)

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def check_expressions(prom: Prometheus, exprs: list[tuple[str, str]]) -> None:
    """Every metric each expression names is exposed by a target, and each expression
    selects at least one series that exists."""
    exposed = prom.metadata_names() | {"up"}
    unknown: list[str] = []
    empty: list[str] = []
    for where, expr in exprs:
        sels = selectors(expr)
        assert sels, f"{where}: no series selector found in {expr!r}"
        for s in sels:
            name = metric_name(s)
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            if name not in exposed and family not in exposed:
                unknown.append(f"{where}: {name}")
        if all(metric_name(s) in NO_SERIES_UNTIL_FIRST for s in sels):
            continue
        if not any(prom.series(s) for s in sels):
            empty.append(f"{where}: {expr}")
    assert not unknown, "metrics no target exposes:\n" + "\n".join(unknown)
    assert not empty, "expressions selecting no existing series:\n" + "\n".join(empty)


# -- the processes --------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def server(etcd_server: EtcdServer) -> AsyncIterator[Proc]:
    """One ``pegaflow-server`` with etcd (its own prefix), with real traffic behind it:
    puts, hit and miss lookups, gets, a malformed control and data-plane request."""
    etcd_server.start()
    prefix = f"/pegaflow-test/prom-live-{uuid.uuid4().hex[:8]}"
    argv = [
        "--node-pool-bytes", "32MiB", "--node-slab-bytes", "4MiB",
        "--etcd-endpoints", etcd_server.endpoint, "--etcd-prefix", prefix,
        "--etcd-lease-ttl-s", "3",
    ]  # fmt: skip
    srv = start_server(extra=argv)
    try:
        await _traffic(srv)
        yield srv
    finally:
        srv.terminate()


async def _traffic(srv: Proc) -> None:
    from pegaflow.client import PegaClient

    from pegaflow.config import ClientConfig
    from tests.support.metrics import malformed_requests

    address = srv.ready["coordinator"]
    client = PegaClient(
        ClientConfig(coordinators=[address], lookup_timeout_s=5.0, transfer_timeout_s=20.0)
    )
    try:
        hashes = [os.urandom(32) for _ in range(4)]
        data = np.random.default_rng(1).integers(0, 255, size=(4, BLOCK), dtype=np.uint8)
        put = await client.put_blocks(NS, [(h, 0, data[i]) for i, h in enumerate(hashes)])
        assert put.stored == 4
        deadline = time.monotonic() + 60
        while (res := await client.lookup(NS, [*hashes, os.urandom(32)])).hits < 4:
            assert time.monotonic() < deadline, "blocks never reached the index"
            await asyncio.sleep(0.1)
        out = np.zeros((4, BLOCK), dtype=np.uint8)
        items = [(res.blocks[i][0], h, 0, out[i]) for i, h in enumerate(hashes)]
        assert all(await client.get_blocks(NS, items))
        assert np.array_equal(out, data)
        await malformed_requests(client, srv.ready["ucx"], address, hashes[0], NS)
    finally:
        await client.close()


def server_targets(srv: Proc) -> dict[str, list[str]]:
    """The server under the coordinator, node and single-host jobs (it serves all
    three's metrics), plus a single-host target nobody listens on: a server down."""
    http = f"127.0.0.1:{srv.ready['http']}"
    return {
        "pegaflow-coordinator": [http],
        "pegaflow-node": [http],
        "pegaflow-server": [http, f"127.0.0.1:{free_port()}"],
    }


def test_config_and_rules_are_valid() -> None:
    """``promtool`` accepts the alert rules, and the example configuration names the
    single-host job the alerts select."""
    if not os.access(PROMTOOL, os.X_OK):
        pytest.skip(NO_PROMETHEUS)
    check = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "job_name: pegaflow-server" in (CONFIGS / "prometheus.yml").read_text()


@needs_prometheus
def test_every_server_query_and_alert_selects_existing_series(server: Proc, tmp_path: Path) -> None:
    prom = Prometheus(tmp_path, {**server_targets(server), ENGINE_JOB: []})
    try:
        for job in ("pegaflow-coordinator", "pegaflow-node", "pegaflow-server"):
            prom.wait(lambda job=job: prom.scraped(job), f"the first scrape of {job}")
        prom.wait(lambda: prom.scraped("pegaflow-server", up=0), "the dead target's scrape")
        prom.wait(prom.rules_evaluated, "the first evaluation of the alert rules")

        # the rules load and evaluate without errors
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        assert {r["name"] for r in rules} == {n.split(" ", 1)[1] for n, _ in alert_rules()}
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not bad, bad

        exprs = [q for q in dashboard_queries() + alert_rules() if not needs_engine(q[1])]
        assert len(exprs) > 30
        check_expressions(prom, exprs)

        # alerts for the single host and for zero targets fire when they should ...
        down = prom.query(alert_expr("PegaFlowServerDown"))
        assert len(down) == 1 and down[0]["metric"]["job"] == "pegaflow-server"
        assert prom.query(alert_expr("PegaFlowNoEngineTargets")), "no engine target: must fire"
        # ... and not when they should not
        for quiet in ("PegaFlowNoCoordinatorTargets", "PegaFlowNoNodeTargets",
                      "PegaFlowNoCoordinatorUp"):  # fmt: skip
            assert not prom.query(alert_expr(quiet)), quiet
    finally:
        prom.close()


# -- the engine (slow) ------------------------------------------------------------------


def wait_engine(engine: Any, sample: str, at_least: float, timeout: float = 60.0) -> None:
    """Until the engine's ``/metrics`` shows ``sample`` >= ``at_least``.  Connector stats
    reach vLLM's frontend with the engine steps after them: a save done after the last
    step waits for the next one, so a prompt shorter than a block (nothing to save or
    load) is sent now and then to make steps."""
    from tests.support.vllm_engine import text_prompt

    deadline = time.monotonic() + timeout
    nudge = time.monotonic() + 2.0
    while (m := engine.metrics()).get(sample, 0) < at_least:
        if time.monotonic() > nudge:
            engine.complete(text_prompt(4, seed=99), max_tokens=1)
            nudge = time.monotonic() + 2.0
        if time.monotonic() > deadline:
            ours = {k: v for k, v in m.items() if "pegaflow" in k and v}
            log = [ln for ln in engine.log if "GET /metrics" not in ln][-40:]
            pytest.fail(f"{sample} never reached {at_least}: {ours}\n" + "\n".join(log))
        time.sleep(0.3)


@pytest.mark.slow
@pytest.mark.vllm
@needs_prometheus
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_every_engine_query_and_alert_selects_existing_series(server: Proc, tmp_path: Path) -> None:
    """A real ``vllm serve`` with the connector: a cold request (lookup, save), then
    the same prompt again (vLLM's own prefix cache is off: the connector loads it);
    Prometheus scrapes its ``/metrics`` as the ``vllm`` job."""
    from tests.support.vllm_engine import VllmServe, text_prompt, tiny_model_with_tokenizer

    model = tiny_model_with_tokenizer(tmp_path / "model")
    engine = VllmServe(
        model,
        {
            "kv_connector": "PegaKVConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "pegaflow.connector",
            "kv_connector_extra_config": {"coordinators": server.ready["coordinator"]},
        },
        extra=["--no-enable-prefix-caching"],
        name="vllm-prom",
    )
    prom = None
    try:
        prompt = text_prompt(300, seed=21)
        engine.complete(prompt, max_tokens=2)

        wait_engine(engine, "vllm:pegaflow_save_blocks_total", 9)  # 9 full blocks
        engine.complete(prompt, max_tokens=2)
        wait_engine(engine, "vllm:pegaflow_load_blocks_total", 9)

        targets = {**server_targets(server), ENGINE_JOB: [engine.url.removeprefix("http://")]}
        prom = Prometheus(tmp_path, targets)
        prom.wait(lambda: prom.scraped(ENGINE_JOB), "the first scrape of the engine")
        prom.wait(lambda: prom.scraped("pegaflow-server"), "the first scrape of the server")
        exprs = [q for q in dashboard_queries() + alert_rules() if needs_engine(q[1])]
        assert len(exprs) > 10
        check_expressions(prom, exprs)
        # the latency histograms count real operations
        for hist in ("lookup", "load", "save"):
            got = prom.query(f"sum(vllm:pegaflow_{hist}_latency_seconds_count)")
            assert got and float(got[0]["value"][1]) >= 1, (hist, got)
        assert not prom.query(alert_expr("PegaFlowNoEngineTargets"))
    finally:
        if prom is not None:
            prom.close()
        engine.terminate()
