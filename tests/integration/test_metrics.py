"""Every documented metric (docs/metrics.md) is served, and real traffic moves the
counters by exactly what it did: real etcd, a real coordinator, two real storage nodes
(``pegaflow.tools.devcluster``), real UCX transfers through ``pegaflow.client``."""

from __future__ import annotations

import asyncio
import os
import re
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from pegaflow.client import PegaClient
from pegaflow.client import data as client_data
from prometheus_client.parser import text_string_to_metric_families

from pegaflow.config import ClientConfig, EtcdConfig
from pegaflow.tools.devcluster import Proc, start_coordinator, start_node
from tests.support.metrics import BLOCK, NS, REPO, documented, family_name, malformed_requests

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> tuple[Samples, dict[str, str]]:
    """(samples by (name, labels), family types) of ``/metrics`` on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples: Samples = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def val(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return val(after, name, **labels) - val(before, name, **labels)


async def eventually(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


class Cluster:
    def __init__(self, coordinator: Proc, nodes: dict[str, Proc]) -> None:
        self.coordinator = coordinator
        self.nodes = nodes

    def http(self, who: str) -> int:
        proc = self.coordinator if who == "coordinator" else self.nodes[who]
        return int(proc.ready["http"])

    def client(self) -> PegaClient:
        return PegaClient(
            ClientConfig(
                coordinators=[self.coordinator.ready["address"]],
                lookup_timeout_s=5.0,
                transfer_timeout_s=20.0,
            )
        )


@pytest.fixture
async def cluster(etcd_config: EtcdConfig) -> AsyncIterator[Cluster]:
    etcd, prefix = etcd_config.endpoints[0], etcd_config.prefix
    coord = start_coordinator(etcd=etcd, prefix=prefix)
    nodes = {
        nid: start_node(nid, etcd=etcd, prefix=prefix, pool="32MiB", slab="4MiB")
        for nid in ("m1", "m2")
    }
    c = Cluster(coord, nodes)
    probe = c.client()
    try:
        deadline = time.monotonic() + 60
        while len(await probe.nodes()) < 2:
            assert time.monotonic() < deadline, "nodes never registered"
            await asyncio.sleep(0.1)
    finally:
        await probe.close()
    yield c
    for p in [*nodes.values(), coord]:
        p.terminate()


async def test_documented_metrics_are_served_and_count_real_traffic(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = documented()
    before = {who: scrape(cluster.http(who))[0] for who in ("coordinator", "m1", "m2")}
    rng = np.random.default_rng(3)
    h1 = [os.urandom(32) for _ in range(8)]
    h2 = [os.urandom(32) for _ in range(4)]
    d1 = rng.integers(0, 255, size=(8, BLOCK), dtype=np.uint8)
    d2 = rng.integers(0, 255, size=(4, BLOCK), dtype=np.uint8)
    unknown = [os.urandom(32) for _ in range(3)]

    client = cluster.client()
    try:
        # puts: 8 blocks to m1 by name, 4 through placement (the least used node: m2)
        put1 = await client.put_blocks(NS, [(h, 0, d1[i]) for i, h in enumerate(h1)], "m1")
        put2 = await client.put_blocks(NS, [(h, 0, d2[i]) for i, h in enumerate(h2)])
        assert (put1.stored, put2.stored) == (8, 4)
        # wait until the coordinator's index has all 12
        deadline = time.monotonic() + 60
        while (await client.lookup(NS, h1 + h2)).hits < 12:
            assert time.monotonic() < deadline, "blocks never reached the index"
            await asyncio.sleep(0.05)
        lookups0 = scrape(cluster.http("coordinator"))[0]
        # two counted lookups: 12 hits + 3 misses, then 0 hits + 3 misses
        res = await client.lookup(NS, h1 + h2 + unknown)
        assert res.hits == 12
        assert (await client.lookup(NS, unknown)).hits == 0
        # gets: every block twice from its node; one block asked from the wrong node
        out = np.zeros((12, BLOCK), dtype=np.uint8)
        items = [(res.blocks[i][0], h, 0, out[i]) for i, h in enumerate(h1 + h2)]
        for _ in range(2):
            assert all(await client.get_blocks(NS, items))
        assert np.array_equal(out[:8], d1) and np.array_equal(out[8:], d2)
        wrong = np.zeros(BLOCK, dtype=np.uint8)
        assert await client.get_blocks(NS, [("m1", h2[0], 0, wrong)]) == [False]
        # a writer whose bytes do not match its checksum: refused at commit
        monkeypatch.setattr(client_data, "checksum", lambda _view: 12345)
        bad = await client.put_blocks(NS, [(os.urandom(32), 0, d1[0])], "m1")
        assert (bad.stored, bad.failed) == (0, 1)
        monkeypatch.undo()
        await malformed_requests(
            client, cluster.nodes["m1"].ready["ucx"], cluster.coordinator.ready["address"], h1[0]
        )
    finally:
        await client.close()

    # pool gauges follow within about a second
    await eventually(
        lambda: (
            val(scrape(cluster.http("m1"))[0], "pegaflow_node_blocks") == 8
            and val(scrape(cluster.http("m2"))[0], "pegaflow_node_blocks") == 4
        ),
        "pool gauges",
    )
    after: dict[str, Samples] = {}
    types: dict[str, dict[str, str]] = {}
    for who in ("coordinator", "m1", "m2"):
        after[who], types[who] = scrape(cluster.http(who))

    # -- every documented name is served, with its documented type --------------------
    served_by = {"coordinator": ["coordinator"], "storage node": ["m1", "m2"]}
    for section, names in docs.items():
        for who in served_by.get(section, []):
            for name, typ in names.items():
                fam = family_name(name, typ)
                hint = (
                    " (the node must pass registry=node.registry to EtcdPublisher)"
                    if "_etcd_" in name and who != "coordinator"
                    else ""
                )
                assert types[who].get(fam) == typ, f"{name} ({typ}) not served by {who}{hint}"
    # ... and nothing PegaFlow serves is undocumented
    known = {family_name(n, t) for names in docs.values() for n, t in names.items()}
    for who in after:
        extra = {
            f
            for f in types[who]
            if f.startswith("pegaflow_") and not f.endswith("_created") and f not in known
        }
        assert not extra, f"{who} serves undocumented metrics: {sorted(extra)}"

    # -- the coordinator ----------------------------------------------------------------
    c0, c1 = lookups0, after["coordinator"]
    assert delta(c0, c1, "pegaflow_coordinator_lookups_total") == 2
    assert delta(c0, c1, "pegaflow_coordinator_lookup_hit_blocks_total") == 12
    assert delta(c0, c1, "pegaflow_coordinator_lookup_miss_blocks_total") == 6
    assert delta(c0, c1, "pegaflow_coordinator_lookup_seconds_count") == 2
    cb = before["coordinator"]
    assert delta(cb, c1, "pegaflow_coordinator_place_total", result="local") == 1
    errors = "pegaflow_coordinator_rpc_errors_total"
    assert delta(cb, c1, errors, op="lookup", code="bad_request") == 1
    assert val(c1, "pegaflow_index_blocks") == 12
    assert val(c1, "pegaflow_index_entries") == 12
    assert val(c1, "pegaflow_index_nodes") == 2
    assert val(c1, "pegaflow_index_namespaces") == 1
    assert val(c1, "pegaflow_index_node_entries", node="m1") == 8
    assert val(c1, "pegaflow_index_node_entries", node="m2") == 4
    assert val(c1, "pegaflow_etcd_connected") == 1
    assert delta(cb, c1, "pegaflow_etcd_watch_events_total") >= 12
    assert val(c1, "pegaflow_etcd_revision") > 0

    # -- the nodes ----------------------------------------------------------------------
    m1b, m1 = before["m1"], after["m1"]
    assert delta(m1b, m1, "pegaflow_node_put_blocks_total") == 8
    assert delta(m1b, m1, "pegaflow_node_put_bytes_total") == 8 * BLOCK
    assert delta(m1b, m1, "pegaflow_node_get_blocks_total", result="hit") == 16
    assert delta(m1b, m1, "pegaflow_node_get_blocks_total", result="miss") == 1
    assert delta(m1b, m1, "pegaflow_node_get_bytes_total") == 16 * BLOCK
    assert delta(m1b, m1, "pegaflow_node_checksum_failures_total") == 1
    errors = "pegaflow_node_request_errors_total"
    assert delta(m1b, m1, errors, op="get", code="bad_request") == 1
    assert delta(m1b, m1, "pegaflow_node_request_seconds_count", op="reserve") == 2
    assert delta(m1b, m1, "pegaflow_node_request_seconds_count", op="commit") == 2
    assert delta(m1b, m1, "pegaflow_node_request_seconds_count", op="get") == 4
    assert val(m1, "pegaflow_node_capacity_bytes") == 32 << 20
    assert val(m1, "pegaflow_node_used_bytes") == 8 * BLOCK
    assert val(m1, "pegaflow_node_evictions") == 0
    assert val(m1, "pegaflow_node_etcd_registered") == 1
    assert delta(m1b, m1, "pegaflow_node_etcd_write_keys_total") >= 8
    assert delta(m1b, m1, "pegaflow_node_etcd_write_batches_total") >= 1
    m2b, m2 = before["m2"], after["m2"]
    assert delta(m2b, m2, "pegaflow_node_put_blocks_total") == 4
    assert delta(m2b, m2, "pegaflow_node_get_bytes_total") == 8 * BLOCK
    assert delta(m2b, m2, "pegaflow_node_checksum_failures_total") == 0
    assert val(m2, "pegaflow_node_used_bytes") == 4 * BLOCK


def test_connector_metrics_are_exported() -> None:
    """What the connector counts reaches vLLM's Prometheus plumbing under the documented
    names: counters and latency histograms of two workers' steps, aggregated as vLLM
    does (``PegaConnectorStats.aggregate``), observed by ``PegaPromMetrics`` with real
    ``prometheus_client`` metric classes (a registry of this test's own)."""
    pytest.importorskip("vllm")
    from functools import partial
    from types import SimpleNamespace

    from pegaflow.connector.metrics import COUNTERS, HISTOGRAMS, LABEL_VALUES, LABELLED, Counters
    from pegaflow.connector.stats import PegaConnectorStats, PegaPromMetrics
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    types = {c: partial(c, registry=reg) for c in (Counter, Gauge, Histogram)}
    prom = PegaPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
        {0: ["m", "0"]},
    )  # fmt: skip

    def samples() -> Samples:
        out: Samples = {}
        for fam in text_string_to_metric_families(generate_latest(reg).decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    labels = {"model_name": "m", "engine": "0"}
    before = samples()
    scheduler, w0, w1 = Counters("scheduler", 0), Counters("worker", 0), Counters("worker", 1)
    scheduler.add("lookups", 3)
    scheduler.add("lookup_hit_blocks", 10)
    scheduler.add("miss_blocks.evicted", 3)
    scheduler.add("lookup_seconds", 0.002)
    scheduler.add("lookup_seconds", 0.2)
    w0.add("load_failed_blocks", 2)
    w0.add("load_seconds", 0.004)
    w1.add("load_seconds", 0.03)
    w1.add("save_seconds", 0.0003)
    w1.add("save_publish_seconds", 0.3)
    step = PegaConnectorStats(data=w0.take_delta())
    step = step.aggregate(PegaConnectorStats(data=w1.take_delta()))
    step = step.aggregate(PegaConnectorStats(data=scheduler.take_delta()))
    assert all(isinstance(v, int | float) for v in step.reduce().values())  # the log line
    prom.observe(step.to_dict(), 0)
    after = samples()
    assert delta(before, after, "vllm:pegaflow_lookups_total", **labels) == 3
    assert delta(before, after, "vllm:pegaflow_lookup_hit_blocks_total", **labels) == 10
    assert delta(before, after, "vllm:pegaflow_load_failed_blocks_total", **labels) == 2
    assert delta(before, after, "vllm:pegaflow_lookup_seconds_total", **labels) == pytest.approx(
        0.202
    )
    lookup = "vllm:pegaflow_lookup_latency_seconds"
    assert delta(before, after, f"{lookup}_count", **labels) == 2
    assert delta(before, after, f"{lookup}_bucket", le="0.0025", **labels) == 1
    assert delta(before, after, f"{lookup}_sum", **labels) == pytest.approx(0.202)
    load = "vllm:pegaflow_load_latency_seconds"
    assert delta(before, after, f"{load}_count", **labels) == 2  # one per worker
    assert delta(before, after, f"{load}_bucket", le="0.005", **labels) == 1
    assert delta(before, after, "vllm:pegaflow_save_latency_seconds_count", **labels) == 1
    publish = "vllm:pegaflow_save_publish_latency_seconds"
    assert delta(before, after, f"{publish}_bucket", le="0.25", **labels) == 0
    assert delta(before, after, f"{publish}_bucket", le="0.5", **labels) == 1

    miss = "vllm:pegaflow_miss_blocks_total"
    assert delta(before, after, miss, cause="evicted", **labels) == 3
    docs = documented()["connector"]
    labelled = {f"{f}.{v}" for f, values in LABEL_VALUES.items() for v in values}
    exposed = {f"vllm:pegaflow_{n}_total" for n in COUNTERS if n not in labelled}
    exposed |= {f"vllm:pegaflow_{f}_total" for f in LABELLED}
    exposed |= {f"vllm:pegaflow_{metric}" for metric, _doc in HISTOGRAMS.values()}
    assert exposed == set(docs), "docs/metrics.md and connector/metrics.py disagree"
    for name, typ in docs.items():
        want = dict(labels)
        if name.removeprefix("vllm:pegaflow_").removesuffix("_total") in LABELLED:
            want["cause"] = "evicted"
        assert (name + ("_count" if typ == "histogram" else ""), tuple(sorted(want.items()))) in (
            after
        ), name


def test_connector_latency_samples_are_bounded() -> None:
    """A flood of operations between two takes keeps a bounded list of durations; the
    counter stays exact."""
    from pegaflow.connector.metrics import MAX_SAMPLES, Counters

    w0 = Counters("worker", 0)
    for _ in range(MAX_SAMPLES + 10):
        w0.add("save_seconds", 0.001)
    flood = w0.take_delta()
    assert len(flood["save_latency_seconds"]) == MAX_SAMPLES  # type: ignore[arg-type]
    assert flood["save_seconds"] == pytest.approx(0.001 * (MAX_SAMPLES + 10))
    assert w0.totals()["save_seconds"] == pytest.approx(0.001 * (MAX_SAMPLES + 10))


def test_dashboards_and_alerts_use_documented_metrics() -> None:
    """The Grafana dashboard and the alert rules are built on the documented names only,
    so a renamed metric cannot silently blank a panel or an alert."""
    import json

    yaml = pytest.importorskip("yaml")

    known: set[str] = set()
    for names in documented().values():
        for name, typ in names.items():
            known.add(name)
            if typ == "histogram":
                known |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    exprs: list[str] = []
    dash = json.loads((REPO / "configs" / "grafana" / "pegaflow-dashboard.json").read_text())
    for panel in dash["panels"]:
        exprs += [t["expr"] for t in panel.get("targets", [])]
    prom = yaml.safe_load((REPO / "configs" / "prometheus.yml").read_text())
    for rules_file in prom["rule_files"]:
        rules = yaml.safe_load((REPO / "configs" / rules_file).read_text())
        exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert len(exprs) > 30
    used = {m for e in exprs for m in re.findall(r"(?<![\w:])(?:vllm:)?pegaflow_[a-z0-9_]+", e)}
    assert used and not used - known, f"undocumented metrics used: {sorted(used - known)}"


def test_dashboard_names_one_datasource() -> None:
    """Every panel and query of the Grafana dashboard reads the dashboard's
    ``datasource`` variable, and the dashboard declares nothing else (no import-time
    ``__inputs`` such as ``DS_PROMETHEUS`` that no panel would use)."""
    import json

    text = (REPO / "configs" / "grafana" / "pegaflow-dashboard.json").read_text()
    dash = json.loads(text)
    assert "__inputs" not in dash and "DS_" not in text
    variables = [v for v in dash["templating"]["list"] if v.get("type") == "datasource"]
    assert [(v["name"], v["query"]) for v in variables] == [("datasource", "prometheus")]
    refs: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "datasource":
                    refs.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dash["panels"])
    assert refs and all(r == {"type": "prometheus", "uid": "${datasource}"} for r in refs), {
        json.dumps(r) for r in refs
    }
