"""``pegaflow-router``: routing logic (pure), the router process on its own, and the
router in front of real ``vllm serve`` CPU replicas.

The end-to-end tests share one set of processes (etcd, a coordinator, two storage nodes
with separate pools standing for two hosts, two ``vllm serve`` replicas, each saving to
its own node) and run in file order: round robin passes answers through unchanged (also
streamed), cache-aware routing sends a conversation's turns to the replica whose node
holds its prefix, a router following the replicas' KV events sends a conversation's
turns to the replica whose own GPU cache holds its prefix, P/D mode answers as one
engine does, and a replica killed mid-stream ends that stream with an error event,
leaves rotation, and the next requests (P/D ones whose prefill replica it was included)
still succeed.  They are slow:
``pytest -m slow tests/e2e/test_router.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pegaflow.router.hashing import BlockHasher, hashable
from pegaflow.router.policy import (
    Picker,
    RecentRoutes,
    Replica,
    node_scores,
    parse_replica,
    parse_replicas,
)
from pegaflow.router.prompts import PromptTokenizer
from pegaflow.router.proxy import REPLICA_HEADER
from pegaflow.router.server import Router
from pegaflow.router.status import render_router, router_healthy

from pegaflow.config import RouterConfig, load_config
from pegaflow.errors import BadRequest
from pegaflow.tools.devcluster import Proc, free_port, start, start_coordinator, start_node
from tests.support.vllm_engine import (
    TINY_MODEL,
    VllmServe,
    connector_stats,
    text_prompt,
    wait_saved,
)

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]

HERE = Path(__file__).resolve().parent
TOKENIZER = str(HERE.parent / "support" / "assets" / "tiny-tokenizer")
HAS_VLLM = importlib.util.find_spec("vllm") is not None
BS = 32

# ---- pure logic ------------------------------------------------------------------------


def test_parse_replica() -> None:
    r = parse_replica("http://10.0.0.5:8000/;role=prefill;node=host-a")
    assert (r.url, r.role, r.node, r.host) == (
        "http://10.0.0.5:8000",
        "prefill",
        "host-a",
        "10.0.0.5",
    )
    assert parse_replica("https://h:1;host=gpu-1").host == "gpu-1"
    for bad in (
        "10.0.0.5:8000",  # no scheme
        "http://h:8000/v1",  # a path
        "http://h:99999",
        "http://h:8000;role=leader",
        "http://h:8000;zone=a",
        "http://h:8000;node=",
    ):
        with pytest.raises(BadRequest):
            parse_replica(bad)


def test_parse_replicas_checks_the_mode() -> None:
    with pytest.raises(BadRequest, match="no replicas"):
        parse_replicas([], "rr")
    with pytest.raises(BadRequest, match="unknown router mode"):
        parse_replicas(["http://a:1"], "fastest")
    with pytest.raises(BadRequest, match="twice"):
        parse_replicas(["http://a:1", "http://a:1/"], "rr")
    with pytest.raises(BadRequest, match="role=decode"):
        parse_replicas(["http://a:1;role=prefill"], "pd")
    reps = parse_replicas(["http://a:1;role=prefill", "http://b:1;role=decode"], "pd")
    assert [r.role for r in reps] == ["prefill", "decode"]


def _replicas(n: int, **kw: Any) -> list[Replica]:
    return [Replica(url=f"http://r{i}:1", healthy=True, **kw) for i in range(n)]


def test_round_robin_and_least_loaded_skip_unhealthy() -> None:
    reps = _replicas(3)
    p = Picker(reps)
    assert [p.round_robin().url for _ in range(6)] == [r.url for r in reps] * 2
    reps[1].healthy = False
    assert {p.round_robin().url for _ in range(4)} == {reps[0].url, reps[2].url}
    reps[0].inflight = 5
    assert p.least_loaded().url == reps[2].url
    assert p.least_loaded(exclude=[reps[2].url]).url == reps[0].url
    for r in reps:
        r.healthy = False
    assert p.round_robin() is None and p.least_loaded() is None


def test_roles() -> None:
    reps = [
        Replica("http://p:1", role="prefill", healthy=True),
        Replica("http://d:1", role="decode", healthy=True),
        Replica("http://b:1", role="both", healthy=True),
    ]
    p = Picker(reps)
    assert {r.url for r in p.candidates("prefill")} == {"http://p:1", "http://b:1"}
    assert {r.url for r in p.candidates("decode")} == {"http://d:1", "http://b:1"}
    assert len(p.candidates("both")) == 3


def test_affinity_prefers_the_holder_within_the_cap() -> None:
    reps = _replicas(3)
    p = Picker(reps, max_inflight=2)
    c = p.by_affinity({reps[1].url: 4, reps[2].url: 2})
    assert (c.replica, c.decision, c.blocks) == (reps[1], "affinity", 4)
    reps[1].inflight = 2  # at the cap: the next best holder
    c = p.by_affinity({reps[1].url: 4, reps[2].url: 2})
    assert (c.replica, c.decision) == (reps[2], "affinity")
    reps[2].inflight = 2  # every holder at the cap: the least loaded of all
    c = p.by_affinity({reps[1].url: 4, reps[2].url: 2})
    assert (c.replica, c.decision) == (reps[0], "capped")
    c = p.by_affinity({})
    assert (c.replica, c.decision) == (reps[0], "miss")
    reps[1].inflight = reps[2].inflight = 0
    reps[1].healthy = False  # an unhealthy holder is no candidate
    assert p.by_affinity({reps[1].url: 9, reps[2].url: 1}).replica == reps[2]


def test_affinity_ties_go_to_the_least_loaded() -> None:
    reps = _replicas(2)
    reps[0].inflight = 1
    c = Picker(reps).by_affinity({reps[0].url: 3, reps[1].url: 3})
    assert c.replica == reps[1]


def test_node_scores_by_node_id_or_host() -> None:
    reps = [
        Replica("http://a:1", node="node-a"),
        Replica("http://b:1", host="10.0.0.2"),
        Replica("http://c:1", host="10.0.0.3"),
    ]
    owners = ["node-a", "node-a", "node-b", "node-a"]
    hosts = {"node-a": "10.0.0.1", "node-b": "10.0.0.2"}
    assert node_scores(reps, owners, hosts) == {"http://a:1": 3, "http://b:1": 1}


def test_recent_routes_longest_prefix_and_bound() -> None:
    rr = RecentRoutes(capacity=2)
    rr.remember([b"a", b"b"], "u1")
    assert rr.longest([b"a", b"b", b"c"]) == (2, "u1")
    assert rr.longest([b"x"]) == (0, "")
    rr.remember([b"c"], "u2")
    rr.remember([b"d"], "u3")  # evicts the oldest
    assert len(rr) == 2 and rr.longest([b"a", b"b"]) == (0, "")


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("seed", ["", "0"])
def test_block_hashes_equal_vllms(algo: str, seed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's chain equals vLLM's own ``hash_block_tokens`` from ``NONE_HASH``,
    with vLLM's fixed seed and with a ``PYTHONHASHSEED``."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    if seed:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    else:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    tokens = [7, *range(3, 200)]
    want, parent = [], None
    for i in range(len(tokens) // 16):
        parent = kcu.hash_block_tokens(fn, parent, tokens[i * 16 : (i + 1) * 16], None)
        want.append(bytes(parent))
    got = BlockHasher(16, algo, seed).hashes(tokens)
    assert got == want and len(got) == 12
    assert BlockHasher(16, algo, seed).hashes(tokens, limit=3) == want[:3]


def test_block_hasher_rejects_what_it_cannot_reproduce(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        BlockHasher(16, "xxhash")
    assert len(BlockHasher(16, "xxhash", "0").hashes(list(range(40)))) == 2
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        BlockHasher(16, "md5")
    with pytest.raises(ValueError):
        BlockHasher(0)


def test_hashable() -> None:
    assert hashable({"prompt": "w5"})
    assert not hashable({"prompt": "w5", "cache_salt": "s"})
    img = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert not hashable({"messages": [{"role": "user", "content": img}]})
    assert hashable({"messages": [{"role": "user", "content": [{"type": "text", "text": "w"}]}]})


def test_tokenizer_asset_matches_the_tiny_model() -> None:
    """The test tokenizer (no download) has exactly the tiny model's vocabulary, and the
    router turns completion and chat prompts into the ids vLLM's server uses."""
    vocab = json.loads((Path(TINY_MODEL) / "config.json").read_text())["vocab_size"]
    tok = PromptTokenizer(TOKENIZER)
    assert tok.loaded and len(tok._hf) == vocab
    assert tok.tokens("/v1/completions", {"prompt": "w5 w6 w1023"}) == [5, 6, 1023]
    assert tok.tokens("/v1/completions", {"prompt": [[9, 8], [7]]}) == [9, 8]
    assert tok.tokens("/v1/completions", {"prompt": ["w9 w8"]}) == [9, 8]
    msgs = [{"role": "user", "content": "w7 w8"}]
    assert tok.tokens("/v1/chat/completions", {"messages": msgs}) == [3, 7, 8, 4]
    assert tok.tokens("/v1/completions", {"prompt": 5}) is None
    assert PromptTokenizer().tokens("/v1/completions", {"prompt": "w5"}) is None
    assert PromptTokenizer().tokens("/v1/completions", {"prompt": [5, 6]}) == [5, 6]
    with pytest.raises(ValueError):
        PromptTokenizer(str(HERE))


def test_prefill_body() -> None:
    body = {"prompt": "w5", "max_tokens": 50, "stream": True, "stream_options": {}, "n": 2}
    pre = Router.prefill_body(body)
    assert pre == {"prompt": "w5", "max_tokens": 1, "stream": False, "n": 1}
    assert (
        Router.prefill_body({"messages": [], "max_completion_tokens": 9})["max_completion_tokens"]
        == 1
    )
    assert body["max_tokens"] == 50  # the original is left as it is


def test_router_config_from_toml_env_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text('[router]\nmode = "cache"\nreplicas = ["http://a:1;node=n1"]\n')
    cfg = load_config(path, env={"PEGAFLOW_ROUTER_MAX_INFLIGHT": "8"})
    assert isinstance(cfg.router, RouterConfig)
    assert (cfg.router.mode, cfg.router.replicas, cfg.router.max_inflight) == (
        "cache",
        ["http://a:1;node=n1"],
        8,
    )


def test_render_router_status() -> None:
    doc = {
        "url": "http://r:1",
        "router": {"mode": "cache", "max_inflight": 4},
        "replicas": [
            Replica("http://a:1", node="n1", healthy=True, inflight=2).status(),
            Replica("http://b:1", healthy=False, last_error="refused").status(),
        ],
        "counters": {"affinity": 3},
    }
    text = render_router(doc)
    assert "1 of 2 replicas healthy" in text and "refused" in text and "affinity 3" in text
    assert not router_healthy(doc)
    assert "unreachable" in render_router({"url": "http://r:1", "error": "unreachable (x)"})


# ---- the router process on its own ----------------------------------------------------


def start_router(*args: str, env: dict[str, str] | None = None) -> tuple[Proc, str]:
    """A ``pegaflow-router`` process on a free port; its base URL."""
    proc = start(
        "pegaflow-router",
        ["pegaflow.router.main", "--router-port", "0", "--router-health-interval-s", "0.5", *args],
        env=env,
    )
    return proc, "http://" + proc.ready["address"]


async def _get(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.get(url) as r:
            return r.status, await r.json()


async def _post(url: str, body: Any, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        data = raw if raw is not None else json.dumps(body).encode()
        async with s.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json()


def assert_metrics_documented(url: str) -> None:
    """Every ``pegaflow_router_*`` family the router serves is in docs/metrics.md's
    Router table with its type, and every name there is served."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support.metrics import documented, family_name

    docs = documented()["router"]
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        types = {f.name: f.type for f in text_string_to_metric_families(r.read().decode())}
    served = {
        n: t
        for n, t in types.items()
        if n.startswith("pegaflow_router_") and not n.endswith("_created")
    }
    assert served == {family_name(n, t): t for n, t in docs.items()}


def test_router_without_replicas_answers_clearly() -> None:
    """Replicas that are not there: the router starts, ``/health`` says 503, a request
    gets a 503 naming the problem at once, a malformed body a 400; the router keeps
    serving.  A bad configuration is one line and exit status 2."""
    from pegaflow.tools.devcluster import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    proc, url = start_router("--router-replicas", f"{dead};node=n1")
    try:
        status, body = asyncio.run(_get(url + "/health"))
        assert status == 503 and "no healthy replica" in body["error"]
        status, body = asyncio.run(_post(url + "/v1/completions", {"prompt": "w5"}))
        assert status == 503 and "no healthy replica" in body["error"]["message"]
        status, body = asyncio.run(_post(url + "/v1/completions", None, raw=b"{not json"))
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        status, body = asyncio.run(_post(url + "/v1/chat/completions", None, raw=b"[1]"))
        assert status == 400
        status, st = asyncio.run(_get(url + "/v1/status"))
        assert status == 200 and st["replicas"][0]["healthy"] is False
        assert "/health" in st["replicas"][0]["last_error"]
        assert_metrics_documented(url)
        assert proc.alive()
    finally:
        proc.terminate()
    bad = subprocess.run(
        [sys.executable, "-m", "pegaflow.router.main", "--router-mode", "pd",
         "--router-replicas", f"{dead};role=decode"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "role=prefill" in bad.stderr, bad.stderr


# ---- end to end with vLLM ---------------------------------------------------------------

THREE_KEYS = {
    "kv_connector": "PegaKVConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "pegaflow.connector",
}


class Cluster:
    """The module's processes: nodes, coordinator, replicas A and B, routers."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []
        self.coordinator = ""
        self.a: VllmServe
        self.b: VllmServe
        self.workdir = Path()
        self.routers: dict[str, str] = {}
        self.events: dict[str, tuple[int, int]] = {}
        """each replica's KV events publisher and replay ports, by name"""

    def replica_spec(self, a_role: str = "both", b_role: str = "both") -> str:
        return f"{self.a.url};role={a_role};node=node-a,{self.b.url};role={b_role};node=node-b"

    def events_spec(self) -> str:
        """Both replicas with their KV events endpoints (no node: GPU caches only)."""
        specs = []
        for name, srv in (("a", self.a), ("b", self.b)):
            pub, replay = self.events[name]
            specs.append(f"{srv.url};events=tcp://127.0.0.1:{pub};replay=tcp://127.0.0.1:{replay}")
        return ",".join(specs)


@pytest.fixture(scope="module")
def cluster(etcd_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not HAS_VLLM:
        pytest.skip("vLLM not installed")
    c = Cluster()
    c.workdir = tmp_path_factory.mktemp("router")
    prefix = f"/pegaflow/router-{os.getpid()}"
    etcd = etcd_server.endpoint
    servers: list[VllmServe] = []
    try:
        for nid in ("node-a", "node-b"):
            c.procs.append(start_node(nid, etcd=etcd, prefix=prefix))
        coord = start_coordinator(etcd=etcd, prefix=prefix)
        c.procs.append(coord)
        c.coordinator = coord.ready["address"]

        def serve(name: str) -> VllmServe:
            env = {
                "PEGAFLOW_CLIENT_COORDINATORS": c.coordinator,
                "PEGAFLOW_CONNECTOR_LOCAL_NODE": f"node-{name}",
                "PEGAFLOW_CONNECTOR_STATS_PATH": str(c.workdir / name),
                "PYTHONHASHSEED": "0",
            }
            pub, replay = c.events[name]
            events = {
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
            }  # fmt: skip
            extra = ["--tokenizer", TOKENIZER, "--enable-prompt-tokens-details",
                     "--kv-events-config", json.dumps(events)]  # fmt: skip
            srv = VllmServe(TINY_MODEL, THREE_KEYS, env=env, extra=extra, name=f"vllm-{name}")
            servers.append(srv)
            return srv

        c.events = {name: (free_port(), free_port()) for name in ("a", "b")}
        with ThreadPoolExecutor(2) as pool:
            c.a, c.b = pool.map(serve, ["a", "b"])
        yield c
    finally:
        for srv in servers:
            srv.kill()
        for p in reversed(c.procs):
            p.kill()


def router(c: Cluster, name: str, *args: str) -> str:
    """A router of the module (started once, by name); its URL."""
    if name not in c.routers:
        proc, url = start_router(*args, env={"PYTHONHASHSEED": "0"})
        c.procs.append(proc)
        c.routers[name] = url
    return c.routers[name]


def completion(url: str, prompt: str | list[int], max_tokens: int = 8, **kw: Any) -> dict[str, Any]:
    body = {"model": TINY_MODEL, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, **kw}  # fmt: skip
    return asyncio.run(_call(url + "/v1/completions", body))


def chat(url: str, content: str, max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": TINY_MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    return asyncio.run(_call(url + "/v1/chat/completions", body))


async def _call(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body``; the JSON answer (streamed: the events' texts joined) and the
    replica that answered (``_replica``)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        async with s.post(url, json=body) as r:
            assert r.status == 200, await r.text()
            replica = r.headers.get(REPLICA_HEADER, "")
            if not body.get("stream"):
                return {**(await r.json()), "_replica": replica}
            events = await _events(r)
    assert events[-1] == "[DONE]", events[-3:]
    texts: list[str] = []
    for ev in events[:-1]:
        d = json.loads(ev)
        assert "error" not in d, d
        for ch in d["choices"]:
            texts.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    return {"text": "".join(texts), "events": len(events), "_replica": replica}


async def _events(r: aiohttp.ClientResponse) -> list[str]:
    events: list[str] = []
    buf = b""
    async for chunk in r.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            if ev.startswith(b"data: "):
                events.append(ev[len(b"data: ") :].decode())
    return events


def text_of(answer: dict[str, Any]) -> str:
    ch = answer["choices"][0] if "choices" in answer else answer
    return ch.get("text") or (ch.get("message") or {}).get("content") or ""


def status(url: str) -> dict[str, Any]:
    return asyncio.run(_get(url + "/v1/status"))[1]


@pytest.mark.slow
@pytest.mark.vllm
def test_round_robin_passes_answers_through(cluster: Cluster) -> None:
    """Answers through the router (plain and streamed, completions and chat) equal the
    replicas' direct answers; round robin spreads them over both replicas."""
    c = cluster
    url = router(c, "rr", "--router-replicas", c.replica_spec())
    for seed in (1, 2):
        prompt = text_prompt(100, seed=seed)
        direct = text_of(completion(c.a.url, prompt))
        assert direct
        via = [completion(url, prompt) for _ in range(2)]
        assert [text_of(v) for v in via] == [direct, direct]
        assert {v["_replica"] for v in via} == {c.a.url, c.b.url}
        streamed = [completion(url, prompt, stream=True) for _ in range(2)]
        assert [s["text"] for s in streamed] == [direct, direct]
        assert all(s["events"] > 2 for s in streamed)  # relayed event by event
    direct_chat = text_of(chat(c.b.url, "w10 w11 w12"))
    assert text_of(chat(url, "w10 w11 w12")) == direct_chat
    status_, models = asyncio.run(_get(url + "/v1/models"))
    assert status_ == 200 and models["data"][0]["id"] == TINY_MODEL
    st = status(url)
    assert st["counters"]["rr"] >= 9 and all(r["healthy"] for r in st["replicas"])


def namespace_of(srv: VllmServe, timeout: float = 120.0) -> str:
    """The PegaFlow namespace the replica logged at its first request."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in srv.log:
            m = re.search(r"PegaFlow namespace (\S+) for", line)
            if m:
                return m.group(1)
        time.sleep(0.2)
    raise AssertionError(f"{srv.name} logged no namespace:\n{srv.tail()}")


@pytest.mark.slow
@pytest.mark.vllm
def test_cache_mode_follows_the_prefix(cluster: Cluster) -> None:
    """Two conversations, each begun directly on one replica (its blocks saved to that
    replica's node): every later turn through the cache-aware router lands on that
    replica, and is a prefix hit there."""
    c = cluster
    completion(c.a.url, text_prompt(40, seed=3))  # the namespace is logged at a first request
    ns = namespace_of(c.a)
    assert namespace_of(c.b) == ns
    url = router(
        c, "cache", "--router-mode", "cache", "--router-replicas", c.replica_spec(),
        "--router-namespace", ns, "--router-tokenizer", TOKENIZER,
        "--router-block-size", str(BS), "--client-coordinators", c.coordinator,
    )  # fmt: skip
    for home, srv, seed in (("b", c.b, 10), ("a", c.a, 20)):
        prompt = text_prompt(6 * BS, seed=seed)
        stats = connector_stats(str(c.workdir / home))
        before = stats.get("save_blocks", 0) + stats.get("save_present_blocks", 0)
        answer = text_of(completion(srv.url, prompt))
        wait_saved(str(c.workdir / home), int(before) + 6)
        for turn in range(1, 4):
            prompt = f"{prompt} {answer} {text_prompt(BS, seed=seed + turn)}"
            r = completion(url, prompt)
            assert r["_replica"] == srv.url, (home, turn, status(url))
            cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 6 * BS, (home, turn, r["usage"])
            answer = text_of(r)
    counters = status(url)["counters"]
    assert counters.get("affinity", 0) == 6, counters


def gpu_view(url: str, replica: str) -> dict[str, Any]:
    """``replica``'s GPU view in the router's ``/v1/status``."""
    rep = next(r for r in status(url)["replicas"] if r["url"] == replica)
    return dict(rep["gpu_view"])


@pytest.mark.slow
@pytest.mark.vllm
def test_cache_mode_follows_the_gpu_cache_by_kv_events(cluster: Cluster) -> None:
    """A router with no pool to ask (no namespace), subscribed to both replicas' KV
    events: a conversation begun directly on one replica (the router never saw it) has
    every later turn routed to that replica, whose own GPU cache serves the prefix; the
    router's hashes equal the engines' (checked on their events)."""
    c = cluster
    url = router(
        c, "events", "--router-mode", "cache", "--router-replicas", c.events_spec(),
        "--router-tokenizer", TOKENIZER, "--router-block-size", str(BS),
    )  # fmt: skip
    for srv, seed in ((c.b, 60), (c.a, 70)):
        prompt = text_prompt(6 * BS, seed=seed)
        answer = text_of(completion(srv.url, prompt))
        deadline = time.monotonic() + 60
        while not (v := gpu_view(url, srv.url))["usable"] or v["blocks"] < 6:
            assert time.monotonic() < deadline, v
            time.sleep(0.2)
        for turn in range(1, 4):
            prompt = f"{prompt} {answer} {text_prompt(BS, seed=seed + turn)}"
            r = completion(url, prompt)
            assert r["_replica"] == srv.url, (srv.name, turn, status(url))
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 6 * BS, r["usage"]
            answer = text_of(r)
    st = status(url)
    assert st["counters"].get("affinity", 0) == 6, st["counters"]
    for rep in st["replicas"]:
        assert rep["gpu_view"]["hash_check"] == "ok", rep
        assert rep["gpu_view"]["resyncs"] == 0 and rep["gpu_view"]["restarts"] == 0, rep
    with urllib.request.urlopen(url + "/metrics", timeout=10) as m:
        text = m.read().decode()
    gpu = re.search(r'pegaflow_router_prefix_blocks_total\{where="gpu"\} (\S+)', text)
    assert gpu and float(gpu.group(1)) >= 6 * 6, text
    # a request's prefill counts in its replica's queue until its first bytes (the whole
    # answer, unstreamed), what the next request's choice prices
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(completion, url, text_prompt(6 * BS, seed=80), 200, ignore_eos=True)
        queued: list[float] = []
        while not pending.done() and not any(queued):
            queued = [r["queued_blocks"] for r in status(url)["replicas"]]
        answered = pending.result()
    assert sorted(queued) == [0.0, 6.0], (queued, answered["_replica"])
    assert [r["queued_blocks"] for r in status(url)["replicas"]] == [0.0, 0.0]


@pytest.mark.slow
@pytest.mark.vllm
def test_pd_mode_answers_as_one_engine(cluster: Cluster) -> None:
    """Prefill on A, decode on B: the answers (plain and streamed) equal a single
    engine's, token for token."""
    c = cluster
    url = router(
        c, "pd", "--router-mode", "pd", "--router-replicas",
        c.replica_spec("prefill", "decode"), "--router-health-interval-s", "3600",
    )  # fmt: skip
    for seed in (30, 31):
        prompt = text_prompt(5 * BS + 7, seed=seed)
        want = text_of(completion(c.b.url, prompt, max_tokens=12))
        got = completion(url, prompt, max_tokens=12)
        assert text_of(got) == want and got["_replica"] == c.b.url
        streamed = completion(url, prompt, max_tokens=12, stream=True)
        assert streamed["text"] == want
    counters = status(url)["counters"]
    assert counters.get("handoff", 0) + counters.get("recompute", 0) == 4, counters


async def _stream_then_kill(url: str, victim: VllmServe) -> tuple[list[str], float]:
    """Stream a long answer from ``victim`` through the router, kill ``victim`` after
    its first events; the events received and how long the end took after the kill."""
    body = {"model": TINY_MODEL, "prompt": text_prompt(50, seed=40), "max_tokens": 1500,
            "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for _ in range(4):  # round robin: until the victim answers
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                if r.headers.get(REPLICA_HEADER) != victim.url:
                    continue
                await r.content.readany()
                os.killpg(victim.popen.pid, signal.SIGKILL)
                t0 = time.monotonic()
                events = await _events(r)
                return events, time.monotonic() - t0
    raise AssertionError("the victim never answered")


@pytest.mark.slow
@pytest.mark.vllm
def test_killed_replica_leaves_rotation(cluster: Cluster) -> None:
    """A killed mid-stream: its stream ends with an error event (no hang), A leaves
    rotation, every next request is answered by B, and P/D requests whose prefill
    replica was A are answered by B recomputing."""
    c = cluster
    url = router(c, "rr", "--router-replicas", c.replica_spec())
    events, took = asyncio.run(_stream_then_kill(url, c.a))
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    assert took < 60, took  # ended, did not wait for the 1500 tokens or a deadline
    prompt = text_prompt(3 * BS, seed=41)
    want = text_of(completion(c.b.url, prompt))
    for _ in range(4):
        r = completion(url, prompt)
        assert text_of(r) == want and r["_replica"] == c.b.url
    st = status(url)
    a = next(r for r in st["replicas"] if r["url"] == c.a.url)
    assert a["healthy"] is False and a["failures"] >= 1, st
    cli = subprocess.run(
        [sys.executable, "-m", "pegaflow.tools.cli", "status", "--coordinators", c.coordinator,
         "--no-health", "--router", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 1, cli.stdout + cli.stderr  # a replica is out of rotation
    assert "1 of 2 replicas healthy" in cli.stdout and "DOWN" in cli.stdout, cli.stdout

    pd = c.routers.get("pd")
    if pd is None:
        pytest.skip("needs test_pd_mode_answers_as_one_engine's router")
    before = status(pd)["counters"].get("recompute", 0)
    r = completion(pd, prompt)  # its health check is hourly: it still believes in A
    assert text_of(r) == want and r["_replica"] == c.b.url
    assert status(pd)["counters"]["recompute"] == before + 1


@pytest.mark.slow
@pytest.mark.vllm
def test_pd_roles_hand_off_through_the_router(cluster: Cluster) -> None:
    """A ``kv_producer`` prefill replica and a ``kv_consumer`` decode replica behind the
    P/D router: the producer's ``kv_transfer_params`` reach the consumer, which loads
    every full block of the prompt (computes at most the last, partial one), and the
    answers (plain and streamed) equal a single engine's, token for token."""
    if importlib.util.find_spec("pegaflow.connector.handoff") is None:
        pytest.skip("the connector has no P/D handoff (connector/handoff.py) yet")
    c = cluster
    started: list[VllmServe] = []

    def serve(role: str, node: str) -> VllmServe:
        env = {
            "PEGAFLOW_CLIENT_COORDINATORS": c.coordinator,
            "PEGAFLOW_CONNECTOR_LOCAL_NODE": node,
            "PYTHONHASHSEED": "0",
        }
        extra = ["--tokenizer", TOKENIZER, "--enable-prompt-tokens-details"]
        ktc = {**THREE_KEYS, "kv_role": role}
        srv = VllmServe(TINY_MODEL, ktc, env=env, extra=extra, name=f"vllm-{role}")
        started.append(srv)
        return srv

    try:
        with ThreadPoolExecutor(2) as pool:
            p, d = pool.map(serve, ["kv_producer", "kv_consumer"], ["node-a", "node-b"])
        url = router(
            c, "pd-roles", "--router-mode", "pd",
            "--router-replicas", f"{p.url};role=prefill;node=node-a,{d.url};role=decode",
        )  # fmt: skip
        for seed, stream in ((50, False), (51, True)):
            prompt = text_prompt(5 * BS + 7, seed=seed)
            got = completion(url, prompt, max_tokens=12, stream=stream)
            if not stream:
                cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached >= 5 * BS, got["usage"]  # only the partial block computed
            want = text_of(completion(p.url, prompt, max_tokens=12))
            assert (got["text"] if stream else text_of(got)) == want
        counters = status(url)["counters"]
        assert counters.get("handoff", 0) == 2, counters
    finally:
        for srv in started:
            srv.kill()
