"""Routers report to the coordinators: the coordinator's ``/v1/status`` lists them
(``routers``), ``pegaflow status`` prints them without ``--router`` and the dashboard
draws a routers table; a router gone stops showing (at once when it stops, after its
report's TTL when it crashes).  Real etcd, coordinator and router processes; the
router's replicas are one that is down and one tiny aiohttp stub that answers
``/health`` (no vLLM: the router is what is under test)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from pegaflow.coordinator.routers import RouterTable

from pegaflow.errors import BadRequest, TooLarge, Unauthorized
from pegaflow.protocol.coordinator import parse_report
from pegaflow.tools.devcluster import Proc, free_port, start, start_coordinator, token_env
from pegaflow.transport.rpc_client import RpcClient
from tests.support.chromium import CHROMIUM, chromium

pytestmark = pytest.mark.etcd

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30.0


def _report(**kw: Any) -> dict[str, Any]:
    rep = {"url": "http://10.0.0.1:8000", "role": "both", "node": "n1", "host": "10.0.0.1",
           "healthy": True, "inflight": 2, "requests": 5, "failures": 0,
           "last_error": ""}  # fmt: skip
    return {"url": "http://r:7790", "mode": "cache", "ttl_ms": 60_000, "started_at": 1.0,
            "max_inflight": 64, "replicas": [rep], "counters": {"affinity": 3}, **kw}  # fmt: skip


# ---- pure logic ------------------------------------------------------------------------


def test_parse_report_checks_every_field() -> None:
    rec = parse_report(_report())
    assert rec["replicas"][0]["inflight"] == 2 and rec["counters"] == {"affinity": 3}
    bad: list[dict[str, Any]] = [
        _report(url="r:7790"),  # no scheme
        _report(ttl_ms=-1),
        _report(ttl_ms=10**9),
        _report(replicas="x"),
        _report(replicas=[{"url": "http://a:1"}]),
        _report(replicas=[{**_report()["replicas"][0], "healthy": 1}]),
        _report(counters={"a": "1"}),
        _report(counters=[1]),
        _report(started_at="now"),
        {"url": "http://r:1"},
    ]
    for args in bad:
        with pytest.raises((BadRequest, TooLarge)):
            parse_report(args)
    with pytest.raises(TooLarge):
        parse_report(_report(replicas=[_report()["replicas"][0]] * 1000))


def test_router_table_scopes_entries_to_their_tenant() -> None:
    """A tenant reports and withdraws its own routers only, within its share of the
    table; a cluster-wide connection may replace or withdraw any entry."""
    table = RouterTable(max_routers=8, max_per_tenant=2)
    table.report(_report(url="http://a:1"), "acme")
    for args in (_report(url="http://a:1"), _report(url="http://a:1", ttl_ms=0)):
        with pytest.raises(Unauthorized, match="another"):
            table.report(args, "beta")
    table.report(_report(url="http://a:1", mode="pd"), "acme")  # its own: replaced
    table.report(_report(url="http://b:1"), "acme")
    with pytest.raises(TooLarge, match="acme"):
        table.report(_report(url="http://c:1"), "acme")
    table.report(_report(url="http://c:1"), "beta")  # another tenant's share is its own
    table.report(_report(url="http://d:1"), None)
    with pytest.raises(Unauthorized):
        table.report(_report(url="http://d:1"), "acme")
    got = {r["url"]: (r["tenant"], r["mode"]) for r in table.status()}
    assert got == {"http://a:1": ("acme", "pd"), "http://b:1": ("acme", "cache"),
                   "http://c:1": ("beta", "cache"), "http://d:1": ("", "cache")}  # fmt: skip
    table.report(_report(url="http://a:1", ttl_ms=0), None)  # the cluster token: any
    table.report(_report(url="http://c:1"), None)  # taken over: now cluster-wide
    table.report(_report(url="http://e:1"), "acme")  # a's slot is free again
    got = {r["url"]: r["tenant"] for r in table.status()}
    assert got == {"http://b:1": "acme", "http://c:1": "", "http://d:1": "",
                   "http://e:1": "acme"}  # fmt: skip


def test_router_table_ttl_withdraw_and_bound() -> None:
    table = RouterTable(max_routers=2)
    table.op_report(_report(url="http://a:1"))
    table.op_report(_report(url="http://b:1", ttl_ms=1))
    with pytest.raises(TooLarge):
        table.op_report(_report(url="http://c:1"))
    time.sleep(0.01)  # b's report (1 ms) has expired
    assert [r["url"] for r in table.status()] == ["http://a:1"]
    table.op_report(_report(url="http://c:1"))
    table.op_report(_report(url="http://a:1", ttl_ms=0))  # a router stopping
    (c,) = table.status()
    assert c["url"] == "http://c:1" and c["mode"] == "cache" and c["last_seen_s"] >= 0


# ---- real processes --------------------------------------------------------------------


@pytest.fixture
def stub_replica() -> Iterator[str]:
    """A replica that answers ``/health`` and ``/v1/completions`` (always ``"stub"``),
    in a thread; its URL."""
    loop = asyncio.new_event_loop()
    port = free_port()
    runner: list[web.AppRunner] = []
    ready = threading.Event()

    async def health(_req: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def completion(_req: web.Request) -> web.Response:
        return web.json_response({"choices": [{"index": 0, "text": "stub"}]})

    async def serve() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completion)
        r = web.AppRunner(app)
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", port).start()
        runner.append(r)
        ready.set()

    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    assert ready.is_set()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner[0].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


@pytest.fixture
def coordinator(etcd_server: Any, etcd_prefix: str) -> Iterator[Proc]:
    proc = start_coordinator(etcd=etcd_server.endpoint, prefix=etcd_prefix)
    yield proc
    proc.terminate()


def _router(
    coord: Proc, replicas: str, interval: float, *extra: str, token: str = ""
) -> tuple[Proc, str]:
    proc = start(
        "pegaflow-router",
        ["pegaflow.router.main", "--router-port", "0", "--router-health-interval-s", "0.5",
         "--router-replicas", replicas, "--client-coordinators", coord.ready["address"],
         "--router-report-interval-s", str(interval), *extra],
        env=token_env(token),
    )  # fmt: skip
    return proc, "http://" + proc.ready["address"]


def _http(coord: Proc, path: str) -> Any:
    url = f"http://127.0.0.1:{coord.ready['http']}{path}"
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _wait_routers(coord: Proc, want: Any, what: str) -> list[dict[str, Any]]:
    """Poll the coordinator's ``/v1/status`` until ``want(routers)`` holds."""
    deadline = time.monotonic() + WAIT_S
    while True:
        routers = _http(coord, "/v1/status")["routers"]
        if want(routers):
            return routers
        assert time.monotonic() < deadline, f"{what}; routers: {routers}"
        time.sleep(0.1)


class _Rows(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "tr" and "data-replica" in a:
            self.rows[a["data-replica"]] = a


def _router_rows(dom: str) -> dict[str, dict[str, str]]:
    """The dashboard's routers table: replica URL -> the row's attributes."""
    p = _Rows()
    p.feed(dom)
    return p.rows


def _pegaflow_status(coord: Proc, token: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pegaflow.tools.cli", "status", "--no-health",
         "--coordinators", coord.ready["address"]],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**os.environ, **token_env(token)},
    )  # fmt: skip


def test_status_and_dashboard_list_a_reporting_router(coordinator: Proc, stub_replica: str) -> None:
    """The router's report reaches the coordinator: /v1/status, ``pegaflow status`` (no
    ``--router``) and /v1/dashboard show its mode and each replica with its health and
    load; a crashed router (SIGKILL: no withdrawal) stops showing once its TTL passed."""
    dead = f"http://127.0.0.1:{free_port()}"
    proc, url = _router(coordinator, f"{stub_replica};node=n1,{dead};host=gpu-9", 0.5)
    try:
        routers = _wait_routers(
            coordinator,
            lambda rs: any(r["url"] == url and r["replicas"][0]["healthy"] for r in rs),
            "the router never reported a healthy stub replica",
        )
        (r,) = routers
        assert r["mode"] == "rr" and r["max_inflight"] == 64 and r["ttl_ms"] == 1500
        up, down = r["replicas"]
        assert (up["url"], up["node"], up["healthy"]) == (stub_replica, "n1", True)
        assert up["inflight"] == 0
        assert (down["url"], down["host"], down["healthy"]) == (dead, "gpu-9", False)
        assert "/health" in down["last_error"]

        out = _pegaflow_status(coordinator)
        assert out.returncode == 1, out.stderr  # a replica is out of rotation
        assert f"router {url}: mode rr, 1 of 2 replicas healthy" in out.stdout
        assert any(stub_replica in line and " ok " in line for line in out.stdout.splitlines())
        assert any(dead in line and "DOWN" in line for line in out.stdout.splitlines())

        (d,) = _http(coordinator, "/v1/dashboard")["routers"]
        assert d["url"] == url and d["replicas_healthy"] == 1 and d["inflight"] == 0
        assert len(d["replicas"]) == 2
        if CHROMIUM is not None:  # the page draws the routers table
            rows = _router_rows(chromium(f"http://127.0.0.1:{coordinator.ready['http']}/",
                                         "--dump-dom"))  # fmt: skip
            assert rows[stub_replica]["data-router"] == url
            assert rows[stub_replica]["data-health"] == "ok"
            assert rows[dead]["data-health"] == "down"
    finally:
        proc.kill()
    _wait_routers(coordinator, lambda rs: not rs, "a killed router still listed past its TTL")
    out = _pegaflow_status(coordinator)
    assert out.returncode == 0 and "router " not in out.stdout, out.stdout


def test_a_stopping_router_withdraws_at_once(coordinator: Proc, stub_replica: str) -> None:
    """SIGTERM: the router withdraws its report, gone long before its TTL (90 s) would
    pass; ``pegaflow status`` then exits 0 with no router listed."""
    proc, url = _router(coordinator, stub_replica, 30)
    try:
        _wait_routers(coordinator, lambda rs: [r["url"] for r in rs] == [url], "no report")
        out = _pegaflow_status(coordinator)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"router {url}: mode rr, 1 of 1 replicas healthy" in out.stdout
    finally:
        proc.terminate()
    assert proc.popen.returncode == 0
    routers = _http(coordinator, "/v1/status")["routers"]
    assert routers == [], "the router's report outlived its withdrawal"


def test_bad_router_report_is_refused_and_the_coordinator_serves_on(coordinator: Proc) -> None:
    async def run() -> None:
        client = RpcClient([coordinator.ready["address"]], timeout=5)
        try:
            with pytest.raises(BadRequest):
                await client.call("router_report", {**_report(), "url": 7})
            with pytest.raises(TooLarge):
                await client.call("router_report", _report(mode="x" * 100))
            assert (await client.call("router_report", _report()))["routers"] == 1
            st = await client.call("status", {})
            assert [r["url"] for r in st["routers"]] == ["http://r:7790"]
        finally:
            await client.close()

    asyncio.run(run())


# ---- tenants -----------------------------------------------------------------------------

ADMIN = "admin"
TENANTS = {"acme": "a-secret", "beta": "b-secret"}


@pytest.fixture
def tenant_coordinator(etcd_server: Any, etcd_prefix: str) -> Iterator[Proc]:
    """A coordinator with the cluster token ``ADMIN`` and the tenants of ``TENANTS``."""
    tokens = ",".join(f"{t}={s}" for t, s in TENANTS.items())
    proc = start_coordinator(
        etcd=etcd_server.endpoint,
        prefix=etcd_prefix,
        token=ADMIN,
        tenants=tokens,
    )
    yield proc
    proc.terminate()


def test_a_tenant_router_reports_its_own_entry_only(
    tenant_coordinator: Proc, stub_replica: str
) -> None:
    """A router given a tenant's token (not the cluster token) is listed, as that
    tenant's; another tenant can neither replace nor withdraw its entry, the cluster
    token can; the router's own withdrawal at SIGTERM works."""
    coord = tenant_coordinator
    proc, url = _router(coord, stub_replica, 0.3, token=TENANTS["acme"])
    try:
        (r,) = _wait_routers(coord, lambda rs: [r["url"] for r in rs] == [url], "no report")
        assert r["tenant"] == "acme" and r["replicas"][0]["url"] == stub_replica

        async def others() -> None:
            beta = RpcClient([coord.ready["address"]], token=TENANTS["beta"], timeout=5)
            admin = RpcClient([coord.ready["address"]], token=ADMIN, timeout=5)
            try:
                for ttl_ms in (60_000, 0):
                    with pytest.raises(Unauthorized, match="another"):
                        await beta.call("router_report", _report(url=url, ttl_ms=ttl_ms))
                await beta.call("router_report", _report(url="http://beta-router:7790"))
                st = await beta.call("status", {})
                got = {r["url"]: r["tenant"] for r in st["routers"]}
                assert got == {url: "acme", "http://beta-router:7790": "beta"}
                await admin.call("router_report", _report(url="http://beta-router:7790", ttl_ms=0))
            finally:
                await beta.close()
                await admin.close()

        asyncio.run(others())
        out = _pegaflow_status(coord, ADMIN)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"router {url}: mode rr, 1 of 1 replicas healthy" in out.stdout
        assert "reported" in out.stdout and "s ago, tenant acme\n" in out.stdout, out.stdout
    finally:
        proc.terminate()
    assert _http(coord, "/v1/status")["routers"] == []
    assert not [line for line in proc.log if "WARNING" in line], proc.log


def test_a_router_with_a_bad_token_warns_once_and_keeps_routing(
    tenant_coordinator: Proc, stub_replica: str
) -> None:
    """A token the coordinator refuses: one WARNING naming the error and the flag to fix,
    however many reports fail; the router serves requests all along and the coordinator
    lists nothing and serves on."""
    coord = tenant_coordinator
    proc, url = _router(coord, stub_replica, 0.2, token="wrong")
    try:
        deadline = time.monotonic() + WAIT_S
        while not [line for line in proc.log if "unauthorized" in line]:
            assert time.monotonic() < deadline, proc.log
            time.sleep(0.1)
        for _ in range(5):  # several more report intervals, each refused
            req = urllib.request.Request(
                url + "/v1/completions", data=b'{"prompt": "x"}',
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(req, timeout=10) as r:
                assert json.loads(r.read())["choices"][0]["text"] == "stub"
            time.sleep(0.2)
        assert proc.alive()
        warned = [line for line in proc.log if "WARNING" in line]
        assert len(warned) == 1, warned
        assert "unauthorized" in warned[0] and "--security-token" in warned[0], warned
        assert _http(coord, "/v1/status")["routers"] == []
    finally:
        proc.terminate()


def test_a_cache_router_refused_its_lookups_warns_once_and_routes_by_load(
    tenant_coordinator: Proc, stub_replica: str
) -> None:
    """Cache mode with a tenant's token but another tenant's namespace: the coordinator
    refuses every lookup; the router says so once at WARNING (what to fix) and routes
    each request by load."""
    coord = tenant_coordinator
    proc, url = _router(
        coord, stub_replica, 0.3,
        "--router-mode", "cache", "--router-namespace", "beta@model",
        "--router-block-size", "4", token=TENANTS["acme"],
    )  # fmt: skip
    try:
        for i in range(4):
            req = urllib.request.Request(
                url + "/v1/completions", data=json.dumps({"prompt": [i] * 16}).encode(),
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(req, timeout=10) as r:
                assert json.loads(r.read())["choices"][0]["text"] == "stub"
        with urllib.request.urlopen(url + "/v1/status", timeout=10) as r:
            assert json.loads(r.read())["counters"] == {"lookup_failed": 4}
        warned = [line for line in proc.log if "WARNING" in line]
        assert len(warned) == 1, warned
        assert "refuses this router's lookups" in warned[0], warned
        assert "--router-namespace" in warned[0] and "tenant@" in warned[0], warned
    finally:
        proc.terminate()
