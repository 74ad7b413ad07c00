"""Several hosts on one machine (issue 35): the cluster as the README brings it up,
across hosts made of Linux namespaces (tests/support/netns_hosts.py), with real vLLM engines.

* h1, h2, h3 on one bridge; etcd on h1; a coordinator on h1 and one on h2; a node on
  every host, started with exactly the README's "Running a cluster" commands (the
  documented ``--node-host`` on h2, the ``auto`` default elsewhere); ``pegaflow
  status`` from every host sees all three nodes ok; a node given a loopback or
  wildcard ``--node-host`` against the remote etcd is refused at start.
* a pod on h1 (own network and IPC namespace, h1's kernel and /dev/shm: the
  Kubernetes layout of configs/k8s): its client's UCX handshake with h1's node is
  accepted, a put and a get are byte-exact, and it finds h1's node as a same-host node;
  a vLLM engine in the pod loads every hit on h1's node from h1's pool file (one that
  names the node, and one configured as the manifest does, which finds it by itself).
* a vLLM engine on h3 computes prompts (saved on h3's node), one on h2 loads them across
  the link: hits, outputs equal to a cold run, and the KV bytes in h2's cache equal h3's.
* h3 cut off: h2's requests for blocks on h3's node still complete, correct, well
  before the transfer deadline; after the link is back, hits return within the node
  lease TTL.

The h2 and h3 engines run their engine core in the runner's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) for the KV oracle (``kv_digest``); the pod's run
as vLLM does by default.

Slow (engine starts, namespaces; needs root): ``pytest -m slow tests/e2e/test_multihost.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import netns_hosts
from tests.support.netns_hosts import Host, NetHosts
from tests.support.vllm_engine import VllmEngine, prompts, wait_saved
from tests.support.vllm_engine import connector_stats as stats

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
"""the venv's console scripts (pegaflow-coordinator, pegaflow-node, pegaflow)"""

pytestmark = [
    pytest.mark.etcd, pytest.mark.ucx,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="no etcd binary"),
]

POOL = "256MiB"
ETCD_PORT = 2379
COORD_PORT = 7700  # the defaults: every host has its own ports
HOSTS = ("h1", "h2", "h3")


class HostProc:
    """A long-running process on a host, in its own process group, output kept."""

    def __init__(
        self,
        host: Host,
        argv: list[str],
        name: str,
        ready: str = r"^READY",
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.host = host
        self.argv = argv
        self._ready_re = re.compile(ready)
        self.match: re.Match[str] | None = None
        self.log: list[str] = []
        self._ready = threading.Event()
        self.popen = subprocess.Popen(
            [*host.prefix, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=REPO,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            line = line.rstrip("\n")
            self.log.append(line)
            if len(self.log) > 5000:
                del self.log[:2500]
            if not self._ready.is_set():
                m = self._ready_re.search(line)
                if m:
                    self.match = m
                    self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 60.0) -> re.Match[str]:
        if not self._ready.wait(timeout) or self.match is None:
            raise AssertionError(f"{self.name} not ready in {timeout} s:\n{self.tail()}")
        return self.match

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log[-n:])

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to the group, SIGKILL after ``timeout``."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(timeout)
            except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            pass


class Cluster:
    """What the module runs on the hosts (filled by the ``cluster`` fixture)."""

    def __init__(self, net: NetHosts) -> None:
        self.net = net
        self.h = {n: net.hosts[n] for n in HOSTS}
        self.procs: list[HostProc] = []
        self.node_ids: dict[str, str] = {}
        self.coordinators: list[str] = []
        self.etcd = f"{self.h['h1'].ip}:{ETCD_PORT}"

    def start(self, host: Host, argv: list[str], name: str, **kw: Any) -> HostProc:
        p = HostProc(host, argv, name, **kw)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.kill()


@pytest.fixture(scope="module")
def net() -> Iterator[NetHosts]:
    why = netns_hosts.available()
    if why is not None:
        pytest.skip(f"no hosts of namespaces here: {why}")
    n = NetHosts()
    try:
        for name in HOSTS:
            n.add_host(name)
        n.add_pod("pod1", n.hosts["h1"])
        yield n
    finally:
        n.close()


@pytest.fixture(scope="module")
def cluster(net: NetHosts) -> Iterator[Cluster]:
    c = Cluster(net)
    data = Path(tempfile.mkdtemp(prefix="pf-multihost-etcd-"))
    try:
        h1 = c.h["h1"]
        client_url = f"http://{h1.ip}:{ETCD_PORT}"
        peer_url = "http://127.0.0.1:2380"  # h1's own loopback
        # the README's commands, addresses replaced (etcd: its data and peer URLs here)
        argv = [
            *readme("etcd", h1.ip), "--name", "pf", "--data-dir", str(data / "data"),
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"pf={peer_url}",
        ]  # fmt: skip
        assert f"--listen-client-urls={client_url}" in argv or client_url in argv, argv
        etcd = c.start(h1, argv, "etcd", ready=r"ready to serve client requests")
        etcd.wait_ready(30)
        coords = [
            c.start(c.h[h], readme("pegaflow-coordinator", h1.ip), f"coordinator-{h}")
            for h in ("h1", "h2")
        ]
        nodes = {}
        for h, host in c.h.items():
            argv = readme("pegaflow-node", h1.ip, **{"64GiB": POOL})
            if h == "h2":  # a given address too; the others take the default (auto)
                argv += ["--node-host", host.ip]
            nodes[h] = c.start(host, argv, f"node-{h}")
        for h, p in zip(("h1", "h2"), coords, strict=True):
            m = p.wait_ready(60)
            assert m.string.split()[1] == f"{c.h[h].ip}:{COORD_PORT}", m.string
            c.coordinators.append(m.string.split()[1])
        for h, p in nodes.items():
            m = p.wait_ready(60)
            fields = dict(kv.split("=", 1) for kv in m.string.split()[1:])
            assert fields["ucx"].rsplit(":", 1)[0] == c.h[h].ip, m.string
            c.node_ids[h] = fields["node"]
        yield c
    finally:
        c.stop_all()
        shutil.rmtree(data, ignore_errors=True)


README_ETCD = "10.0.0.1"
"""the etcd host's address in the README's commands (replaced by h1's)"""


def readme_commands() -> dict[str, list[str]]:
    """The README's "Running a cluster" commands by program (``pegaflow status`` as
    ``pegaflow``), continuation lines joined, comments and the engine line left out."""
    text = (REPO / "README.md").read_text().split("## Running a cluster", 1)[1]
    block = text.split("\n\n", 2)[1]  # the indented block after the heading
    cmds: dict[str, list[str]] = {}
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "vllm serve" in line:
            continue
        argv = line.split()
        cmds[argv[0]] = argv
    return cmds


def readme(program: str, etcd_ip: str, **replace: str) -> list[str]:
    """The README's command of ``program`` with its addresses (and any other word in
    ``replace``) replaced, run from the venv's console scripts."""
    argv = [replace.get(a, a.replace(README_ETCD, etcd_ip)) for a in readme_commands()[program]]
    if argv[0].startswith("pegaflow"):
        argv[0] = str(BIN / argv[0])
    return argv


def status(host: Host, coordinator: str) -> subprocess.CompletedProcess[str]:
    argv = readme("pegaflow", "", **{f"{README_ETCD}:{COORD_PORT}": coordinator})
    return host.run(argv, timeout=60)


# -- 1. bring-up as the README says -----------------------------------------------------


def test_status_from_every_host_sees_every_node(cluster: Cluster) -> None:
    want = {cluster.node_ids[h]: cluster.h[h].ip for h in HOSTS}
    deadline = time.monotonic() + 60
    for name in (*HOSTS, "pod1"):
        host = cluster.net.hosts[name]
        for coord in cluster.coordinators:
            while True:  # the nodes register within a moment of READY
                r = status(host, coord)
                if r.returncode == 0 and "3 node(s)" in r.stdout:
                    break
                assert time.monotonic() < deadline, (name, coord, r.returncode, r.stdout, r.stderr)
                time.sleep(0.5)
            assert "health: all nodes ok" in r.stdout, r.stdout
            for nid, ip in want.items():
                row = next((ln for ln in r.stdout.splitlines() if ln.startswith(nid + " ")), "")
                assert f" {ip}:" in row and " ok " in row, (nid, r.stdout)


@pytest.mark.parametrize("bad", ["127.0.0.1", "0.0.0.0"])
def test_node_with_loopback_or_wildcard_host_is_refused(cluster: Cluster, bad: str) -> None:
    r = cluster.h["h3"].run(
        [str(BIN / "pegaflow-node"), "--etcd-endpoints", cluster.etcd, "--node-host", bad,
         "--node-pool-bytes", POOL, "--node-ucx-port", "7801", "--node-http-port", "7881"],
        timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "--node-host" in r.stderr and bad in r.stderr, r.stderr
    assert ("loopback" if bad.startswith("127") else "wildcard") in r.stderr, r.stderr
    assert "READY" not in r.stdout


# -- 4. a pod beside h1's node (the configs/k8s layout) ---------------------------------

POD_SCRIPT = r"""
import asyncio, json, os, sys
from pegaflow.client import PegaClient
from pegaflow.config import ClientConfig

async def main(coord, node_id):
    out = {}
    cfg = ClientConfig(coordinators=[coord], lookup_timeout_s=2.0)
    c = PegaClient(cfg)
    try:
        ns = "multihost-pod"
        blocks = [(os.urandom(16), 0, os.urandom(64 << 10)) for _ in range(8)]
        put = await c.put_blocks(ns, blocks, node_id=node_id)
        out["stored"] = put.stored
        for _ in range(100):  # committed blocks reach the index through etcd
            look = await c.lookup(ns, [h for h, _, _ in blocks])
            if look.hits == len(blocks):
                break
            await asyncio.sleep(0.1)
        out["hits"] = look.hits
        bufs = [bytearray(64 << 10) for _ in blocks]
        got = await c.get_blocks(ns, [(node_id, h, s, b) for (h, s, _), b in zip(blocks, bufs)])
        out["got"] = sum(got)
        out["exact"] = all(bytes(b) == d for (_, _, d), b in zip(blocks, bufs))
    finally:
        await c.close()
    c = PegaClient(cfg)  # a fresh client: same-host discovery from scratch
    try:
        local = await c.local_nodes()
        out["local_nodes"] = [n.record.node_id for n in local]
        out["pool_paths"] = [n.pool.path for n in local]
        if not local:  # why not: the two conditions of PegaClient.local_nodes
            from pegaflow.client.samehost import may_be_here, opens_as_node_file
            from pegaflow.deadline import Deadline
            rec = (await c.nodes())[node_id]
            out["published_pool_file"] = rec.pool_file
            out["may_be_here"] = may_be_here(rec)
            pool = await c._data.pool_file(rec.ucx_address, Deadline.of(5.0), expect_node=node_id)
            out["pool_offered"] = None if pool is None else pool.path
            out["pool_opens"] = pool is not None and opens_as_node_file(pool)
    finally:
        await c.close()
    print("POD " + json.dumps(out), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.fixture(scope="module")
def pod_run(cluster: Cluster) -> dict[str, Any]:
    """The pod's script, run once: its client as configs/k8s/vllm-deployment.yaml sets
    it up (the coordinators, and PEGAFLOW_CLIENT_HOST = the host's address)."""
    pod = cluster.net.hosts["pod1"]
    nid = cluster.node_ids["h1"]
    env = {"PEGAFLOW_CLIENT_HOST": cluster.h["h1"].ip}
    r = pod.run(
        [sys.executable, "-c", POD_SCRIPT, cluster.coordinators[0], nid], timeout=120, env=env
    )
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("POD ")), "")
    assert r.returncode == 0 and line, (r.returncode, r.stdout, r.stderr[-4000:])
    out: dict[str, Any] = json.loads(line[4:])
    print("pod:", out)
    return out


def test_pod_put_and_get_with_its_hosts_node(pod_run: dict[str, Any]) -> None:
    """The UCX handshake of a client in a pod with its host's node is accepted (a pod
    has the node's boot id but its own network and IPC namespaces), and blocks put
    and got back are byte-exact."""
    out = pod_run
    assert out["stored"] == 8 and out["hits"] == 8 and out["got"] == 8, out
    assert out["exact"], out


def test_pod_finds_its_hosts_node_as_same_host(cluster: Cluster, pod_run: dict[str, Any]) -> None:
    """The pod sees h1's pool file (h1's /dev/shm is mounted in it), so the same-host
    discovery finds h1's node, as configs/k8s/vllm-deployment.yaml says it does."""
    out = pod_run
    assert out["local_nodes"] == [cluster.node_ids["h1"]], out  # else: why, in ``out``


# -- 2. a hit across hosts, real vLLM engines -------------------------------------------

BS = 32
MAX_TOKENS = 8
FULL = 9  # full blocks of each 300-token prompt (the hit is all of them)
WARM = {"h2": prompts(1, 100, seed=350), "h3": prompts(1, 100, seed=356)}  # first requests
X = prompts(2, 300, seed=351)  # computed on h3, loaded on h2
C = prompts(3, 300, seed=352)  # cold on h2: TTFT without hits
T = prompts(3, 300, seed=353)  # computed on h3, TTFT of hits on h2
# long enough that computing them takes longer than the load budget's floor (50 ms) on
# the tiny model, as a real model's prompts do: the 2x-of-cold target is about those
P = prompts(2, 3600, seed=354)  # computed on h3, asked on h2 while h3 is cut off
P_COLD = prompts(3, 3600, seed=358)  # cold on h2: TTFT of P's length without hits
Q = prompts(30, 300, seed=355)  # computed on h3, asked on h2 after the link is back


class Engines:
    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.running: dict[str, VllmEngine] = {}

    def stats_path(self, name: str) -> str:
        return str(self.workdir / name)

    def spec(self, name: str, **kw: Any) -> dict[str, Any]:
        return {
            "block_size": BS,
            "kv_cache_bytes": 64 << 20,
            "max_model_len": 4096,  # P's prompts
            "connector": {
                "coordinators": ",".join(self.cluster.coordinators),
                "stats_path": self.stats_path(name),
                "lookup_timeout_s": 0.5,  # a busy 2-core machine
                **kw,
            },
        }

    def start(self, names_hosts_specs: list[tuple[str, Host, dict[str, Any]]]) -> None:
        """Start engines at once (each start is mostly waiting)."""
        errors: list[BaseException] = []
        lock = threading.Lock()

        def one(name: str, host: Host, spec: dict[str, Any]) -> None:
            try:
                e = VllmEngine(spec, env=ENGINE_ENV, name=name, prefix=host.prefix)
            except BaseException as exc:  # reported below
                with lock:
                    errors.append(exc)
                return
            with lock:
                self.running[name] = e

        threads = [threading.Thread(target=one, args=a) for a in names_hosts_specs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def stop(self) -> None:
        for e in self.running.values():
            e.kill()  # a cache that outlives its engines: nothing to drain here


ENGINE_ENV = {
    "PYTHONHASHSEED": "0",  # hits hash alike in every engine
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the runner: kv_digest
}


@pytest.fixture(scope="module")
def engines(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    es = Engines(cluster, tmp_path_factory.mktemp("multihost"))
    try:
        # h2 claims every hit: the tiny model computes faster than a load crosses the
        # link, and these loads are the point (the load budget still bounds each)
        es.start([
            ("h3", cluster.h["h3"], es.spec("h3")),
            ("h2", cluster.h["h2"], es.spec("h2", cost_model=False)),
        ])  # fmt: skip
        for name, e in es.running.items():
            e.generate(WARM[name], 1)
            wait_saved(es.stats_path(name), 3, timeout=60)  # its 3 full blocks
        yield es
    finally:
        es.stop()


def node_blocks(cluster: Cluster) -> dict[str, int]:
    """Blocks each node holds (its /v1/status, asked from h1)."""
    out = {}
    for h in cluster.node_ids:
        r = cluster.h["h1"].run(["curl", "-sf", f"http://{cluster.h[h].ip}:7880/v1/status"])
        assert r.returncode == 0, (h, r.stderr)
        out[h] = int(json.loads(r.stdout)["node"].get("blocks", 0))
    return out


def saved_on_h3(engines: Engines, batch: list[list[int]], before: float) -> dict[str, Any]:
    """``batch`` computed cold by h3's engine and saved (to h3's node)."""
    e3 = engines.running["h3"]
    r = e3.generate(batch, MAX_TOKENS)
    assert r["cached"] == [0] * len(batch), r
    full = sum(len(p) // BS for p in batch)
    s = wait_saved(engines.stats_path("h3"), int(before) + full, timeout=60)
    assert s.get("save_blocks", 0) + s.get("save_present_blocks", 0) >= before + full
    return r


def wait_stats(path: str, cond: Any, timeout: float = 120.0) -> dict[str, float]:
    """An engine's connector counters once ``cond`` holds (they are written 0.3 s after
    they change); fails with them after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(path)
        if cond(s):
            return s
        assert time.monotonic() < deadline, f"counters never satisfied the condition: {s}"
        time.sleep(0.2)


FIGURES: dict[str, Any] = {}


@pytest.mark.vllm
def test_hit_across_hosts(cluster: Cluster, engines: Engines) -> None:
    """h3's engine computes X (saved on h3's node); h2's engine gets every full block of
    it across the link: same outputs, and the very KV bytes h3 computed."""
    e2, e3 = engines.running["h2"], engines.running["h3"]
    s2, s3 = engines.stats_path("h2"), engines.stats_path("h3")
    before = node_blocks(cluster)
    saved0 = stats(s3).get("save_blocks", 0) + stats(s3).get("save_present_blocks", 0)
    ref = saved_on_h3(engines, X + T, saved0)
    after = node_blocks(cluster)
    assert after["h3"] - before["h3"] >= FULL * len(X + T), (before, after)  # on h3's node
    assert after["h2"] == before["h2"] and after["h1"] == before["h1"], (before, after)
    want = [e3.kv_digest(p) for p in X]
    assert all(len(d) == FULL and None not in d for d in want), want
    assert len({d for ds in want for d in ds}) == FULL * len(X), want  # the oracle tells apart

    cold = e2.ttft(C)
    assert cold["cached"] == [0] * len(C), cold
    loads0 = stats(s2).get("load_blocks", 0)
    r = e2.generate(X, MAX_TOKENS)
    assert r["outputs"] == ref["outputs"][: len(X)], r  # h3's cold run: no cache
    assert r["cached"] == [FULL * BS] * len(X), r
    got = [e2.kv_digest(p) for p in X]
    assert got == want, "h2's KV cache holds other bytes than h3 computed"
    warm = e2.ttft(T)
    assert warm["cached"] == [FULL * BS] * len(T), warm
    st = wait_stats(s2, lambda s: s.get("load_blocks", 0) - loads0 >= FULL * len(X + T))
    assert st.get("load_failed_blocks", 0) == 0, st
    FIGURES["cold_ttft_ms"] = sorted(cold["ttft_ms"])[len(C) // 2]
    FIGURES["cross_host_ttft_ms"] = sorted(warm["ttft_ms"])[len(T) // 2]
    print(f"\nTTFT on h2, median of {len(C)}: cold {FIGURES['cold_ttft_ms']:.1f} ms, "
          f"hits loaded from h3 {FIGURES['cross_host_ttft_ms']:.1f} ms; "
          f"KV digests equal for {len(X)}x{FULL} blocks")  # fmt: skip


# -- 3. h3 cut off: bounded, correct; back within a lease TTL ---------------------------

LEASE_TTL_S = 10.0  # pegaflow/config/schema.py EtcdConfig.lease_ttl_s (the nodes' default)
TRANSFER_TIMEOUT_S = 10.0  # connector/settings.py (the engines' default)
HANG_BOUND_S = 5.0
"""a call on a cut-off node's blocks that takes this long waited on the transfer
deadline (10 s), not on the load budget"""


@pytest.mark.vllm
def test_partition_then_recovery(cluster: Cluster, engines: Engines) -> None:
    """h3 cut off while its node holds P and Q: h2's engine asks for them, each call
    completes (no wait on the transfer deadline) with correct outputs; after the link
    is back, h2's engine hits h3's blocks again within the lease TTL + 3 s."""
    e2 = engines.running["h2"]
    s2, s3 = engines.stats_path("h2"), engines.stats_path("h3")
    saved0 = stats(s3).get("save_blocks", 0) + stats(s3).get("save_present_blocks", 0)
    ref = saved_on_h3(engines, P, saved0)
    saved1 = stats(s3).get("save_blocks", 0) + stats(s3).get("save_present_blocks", 0)
    refq = saved_on_h3(engines, Q, saved1)
    # cold TTFT of P's length on h2 (prompts nobody stored): the 2x target's reference
    cold_ms = sorted(e2.call({"op": "ttft", "prompts": P_COLD})["ttft_ms"])[1]
    FIGURES["partition_cold_ttft_ms"] = cold_ms

    keys = ("lookup_hit_blocks", "load_blocks", "load_failed_blocks", "load_unreachable_blocks",
            "unreachable_declined_blocks", "cost_declined_blocks")  # fmt: skip
    c0 = stats(s2)
    cluster.net.cut(cluster.h["h3"])
    cut_at = time.monotonic()
    try:
        t = e2.call({"op": "ttft", "prompts": [P[0]]}, timeout=HANG_BOUND_S + 30)
        ttft_ms = t["ttft_ms"][0]
        r = e2.call(
            {"op": "generate", "prompts": [P[1]], "max_tokens": MAX_TOKENS},
            timeout=HANG_BOUND_S + 30,
        )
        gen_s = r["elapsed_s"]
        assert r["outputs"] == [ref["outputs"][1]], r
        # P[0] was computed by h2 itself (its KV now in h2's prefix cache): same output
        r0 = e2.generate([P[0]], MAX_TOKENS)
        assert r0["outputs"] == [ref["outputs"][0]], r0
        cut_for = time.monotonic() - cut_at
    finally:
        cluster.net.restore(cluster.h["h3"])
    restored_at = time.monotonic()
    time.sleep(0.5)  # the counters of the cut-off calls are written
    c1 = stats(s2)
    print("\nh2's connector while h3 was cut off:",
          {k: c1.get(k, 0) - c0.get(k, 0) for k in keys}, "ttft cached", t["cached"])  # fmt: skip
    FIGURES["partition_ttft_ms"] = ttft_ms
    ratio = ttft_ms / cold_ms if cold_ms else float("nan")
    FIGURES["partition_ratio"] = ratio
    print(f"partition: TTFT {ttft_ms:.1f} ms on blocks of the cut-off h3 "
          f"({ratio:.2f}x cold {cold_ms or float('nan'):.1f} ms), a generate of "
          f"{MAX_TOKENS} tokens {gen_s * 1e3:.1f} ms; h3 cut for {cut_for:.1f} s")  # fmt: skip
    assert ttft_ms < HANG_BOUND_S * 1e3, ttft_ms
    assert gen_s < HANG_BOUND_S, gen_s
    assert cut_for < LEASE_TTL_S, "the partition outlived h3's lease: not the case tested"

    loads0 = stats(s2).get("load_blocks", 0)
    recovered = None
    for i, q in enumerate(Q):  # one new prompt at a time, until its blocks load again
        r = e2.generate([q], MAX_TOKENS)
        assert r["outputs"] == [refq["outputs"][i]], (i, r)
        if r["cached"][0] >= FULL * BS:
            recovered = time.monotonic() - restored_at
            break
        if time.monotonic() - restored_at > LEASE_TTL_S + 3 + 5:
            break
        time.sleep(0.5)
    FIGURES["recovery_s"] = recovered
    print(f"hits on h3's node again {recovered if recovered is None else round(recovered, 2)} "
          f"s after the link came back (bound: lease TTL {LEASE_TTL_S:.0f} s + 3 s)")  # fmt: skip
    assert recovered is not None and recovered <= LEASE_TTL_S + 3 + 2, recovered
    wait_stats(s2, lambda s: s.get("load_blocks", 0) > loads0)


# -- 4b. vLLM engines in the pod ---------------------------------------------------------

L = prompts(2, 600, seed=357)  # 18 full blocks each
FULL_L = 18


@pytest.fixture(scope="module")
def pod_engines(cluster: Cluster, engines: Engines) -> Iterator[Engines]:
    """Two engines in the pod on h1: "pinned" names h1's node (``local_node``), "k8s" is
    configured as configs/k8s/vllm-deployment.yaml does (the three keys, the
    coordinators and PEGAFLOW_CLIENT_HOST in the environment: its node is found by
    itself).  Both claim every hit (cost model off: the point is where loads come from)."""
    pod = cluster.net.hosts["pod1"]
    es = Engines(cluster, engines.workdir)
    k8s_env = {
        "PYTHONHASHSEED": "0",
        "PEGAFLOW_CLIENT_COORDINATORS": ",".join(cluster.coordinators),
        "PEGAFLOW_CLIENT_HOST": cluster.h["h1"].ip,
        "PEGAFLOW_CONNECTOR_COST_MODEL": "false",
        "PEGAFLOW_CONNECTOR_STATS_PATH": es.stats_path("pod-k8s"),
        "PEGAFLOW_CONNECTOR_LOOKUP_TIMEOUT_S": "0.5",
    }
    pinned = es.spec("pod-pinned", local_node=cluster.node_ids["h1"], cost_model=False)
    errors: list[BaseException] = []

    def one(name: str, spec: dict[str, Any], env: dict[str, str]) -> None:
        try:
            es.running[name] = VllmEngine(spec, env=env, name=name, prefix=pod.prefix)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=one, args=("pod-pinned", pinned, {"PYTHONHASHSEED": "0"})),
        threading.Thread(
            target=one, args=("pod-k8s", {"block_size": BS, "kv_cache_bytes": 64 << 20,
                                          "three_keys": True}, k8s_env)
        ),
    ]  # fmt: skip
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        yield es
    finally:
        es.stop()


@pytest.fixture(scope="module")
def pod_reference(cluster: Cluster, pod_engines: Engines) -> dict[str, Any]:
    """L computed cold by the pinned pod engine: saved on h1's node (its local node)."""
    e = pod_engines.running["pod-pinned"]
    path = pod_engines.stats_path("pod-pinned")
    before = node_blocks(cluster)
    r = e.generate(L, MAX_TOKENS)
    assert r["cached"] == [0, 0], r
    wait_saved(path, FULL_L * len(L), timeout=60)
    after = node_blocks(cluster)
    assert after["h1"] - before["h1"] >= FULL_L * len(L), (before, after)
    return r


def _loads_from_pool(engines: Engines, name: str, ref: dict[str, Any]) -> dict[str, float]:
    e = engines.running[name]
    path = engines.stats_path(name)
    s0 = stats(path)
    r = e.generate(L, MAX_TOKENS)
    assert r["outputs"] == ref["outputs"], r
    assert r["cached"] == [FULL_L * BS] * len(L), r
    time.sleep(0.5)
    s1 = stats(path)
    keys = ("load_blocks", "local_load_blocks", "layerwise_load_jobs", "load_failed_blocks")
    d = {k: s1.get(k, 0) - s0.get(k, 0) for k in keys}
    print(f"\n{name}: {d}")
    return d


@pytest.mark.vllm
def test_pod_engine_pinned_to_its_hosts_node_loads_from_the_pool_file(
    pod_engines: Engines, pod_reference: dict[str, Any]
) -> None:
    """The pinned pod engine, its prefix cache emptied, gets L back: every block
    straight from h1's pool file (100% same-host loads), same outputs."""
    pod_engines.running["pod-pinned"].call({"op": "reset_prefix_cache"})
    d = _loads_from_pool(pod_engines, "pod-pinned", pod_reference)
    assert d["local_load_blocks"] >= FULL_L * len(L), d
    assert d["load_failed_blocks"] == 0, d


@pytest.mark.vllm
def test_pod_engine_as_deployed_loads_from_the_pool_file(
    pod_engines: Engines, pod_reference: dict[str, Any]
) -> None:
    """The pod engine configured as the Kubernetes manifest does gets L (on h1's node)
    with the same outputs, every block from h1's pool file (100% same-host loads)."""
    d = _loads_from_pool(pod_engines, "pod-k8s", pod_reference)
    assert d["load_failed_blocks"] == 0, d
    assert d["local_load_blocks"] >= FULL_L * len(L), d
