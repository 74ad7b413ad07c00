"""The router's failure behaviours, fast: a real ``pegaflow-router`` process and a real
HTTP client in front of fake-but-real-HTTP replicas (aiohttp servers speaking the part
of the OpenAI API the router relays), each of which can be told to die or hang at a
given point of an answer.  What each test shows is in docs/router.md's *Failures and
deadlines*: a replica failing before the first byte is retried elsewhere, one failing
or going silent mid-stream ends that stream with an error event, leaves rotation and is
never a hang, P/D recomputes without the prefill, a client leaving closes upstream.
The same with real ``vllm serve`` replicas: ``tests/e2e/test_router.py`` (slow)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pegaflow.router.proxy import REPLICA_HEADER

from pegaflow.tools.devcluster import Proc, free_port, start
from tests.support.waiting import wait_for

CLIENT_TIMEOUT_S = 60.0
"""the test client's own bound: far over every router deadline a test sets, so a test
that reaches it shows a hang"""
EVENTS_BEFORE = 2
"""events a failing replica sends before it dies or goes silent"""


def _event(i: int) -> bytes:
    chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f"t{i}"}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


class FakeReplica:
    """An OpenAI-style replica on a loop thread.  ``behaviour``:

    * ``ok``: answers (streams ``events`` events then ``[DONE]``);
    * ``reset``: resets the connection as a request arrives (a process dying);
    * ``die_mid_stream``: sends ``EVENTS_BEFORE`` events, then dies (connection reset,
      ``/health`` refused from then on);
    * ``hang``: never answers a request (a frozen process);
    * ``hang_mid_stream``: sends ``EVENTS_BEFORE`` events, then nothing (nor /health);
    * ``drip``: a stream that never ends, an event every 0.1 s.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.behaviour = "ok"
        self.events = 4
        self.dead = False
        self.frozen = False
        self.bodies: list[dict[str, Any]] = []
        self.client_left = threading.Event()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._release: asyncio.Event | None = None

    # ---- life cycle -------------------------------------------------------------------

    def start(self) -> FakeReplica:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(10)
        return self

    async def _serve(self) -> None:
        self._release = asyncio.Event()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completion)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def stop(self) -> None:
        async def down() -> None:
            assert self._release is not None and self._runner is not None
            self._release.set()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    async def _hang(self) -> None:
        assert self._release is not None
        await self._release.wait()

    # ---- handlers ---------------------------------------------------------------------

    async def _health(self, req: web.Request) -> web.StreamResponse:
        if self.frozen:
            await self._hang()
        if self.dead:
            assert req.transport is not None
            req.transport.abort()
        return web.Response(text="ok")

    async def _models(self, _req: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    async def _completion(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        self.bodies.append(body)
        b = self.behaviour
        assert req.transport is not None
        if b == "reset" or self.dead:
            req.transport.abort()
            return web.Response()
        if b == "hang":
            self.frozen = True
            await self._hang()
        if not body.get("stream"):
            answer: dict[str, Any] = {
                "object": "text_completion",
                "choices": [{"index": 0, "text": self.name}],
            }
            if body.get("max_tokens") == 1 and "kv_transfer_params" not in body:
                answer["kv_transfer_params"] = {"from": self.name}
            return web.json_response(answer)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(req)
        try:
            n = EVENTS_BEFORE if b in ("die_mid_stream", "hang_mid_stream") else self.events
            for i in range(n if b != "drip" else 1 << 30):
                await out.write(_event(i))
                await asyncio.sleep(0.1 if b == "drip" else 0.01)
            if b == "die_mid_stream":
                self.dead = True
                req.transport.abort()
                return out
            if b == "hang_mid_stream":
                self.frozen = True
                await self._hang()
            await out.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            self.client_left.set()
        return out


@pytest.fixture
def fakes() -> Iterator[tuple[FakeReplica, FakeReplica]]:
    """Replicas ``a`` and ``b``, both answering."""
    a, b = FakeReplica("a").start(), FakeReplica("b").start()
    yield a, b
    for r in (a, b):
        r.stop()


def _router(replicas: str, *args: str) -> tuple[Proc, str]:
    """A ``pegaflow-router`` on a free port, health checks hourly (so what a failure did
    to rotation stays visible) unless ``args`` say otherwise; its URL."""
    proc = start(
        "pegaflow-router",
        ["pegaflow.router.main", "--router-port", "0", "--router-health-interval-s", "3600",
         "--router-replicas", replicas, "--router-report-interval-s", "0", *args],
    )  # fmt: skip
    return proc, "http://" + proc.ready["address"]


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/v1/status", timeout=10) as r:
        return json.loads(r.read())


def _healthy(url: str) -> dict[str, bool]:
    return {r["url"]: r["healthy"] for r in _status(url)["replicas"]}


async def _stream(url: str, body: dict[str, Any]) -> tuple[int, str, list[str]]:
    """POST a streamed completion; (status, the answering replica, the events' data)."""
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.post(url + "/v1/completions", json={**body, "stream": True}) as r:
            events = []
            async for line in r.content:
                text = line.decode().strip()
                if text.startswith("data: "):
                    events.append(text[len("data: ") :])
            return r.status, r.headers.get(REPLICA_HEADER, ""), events


async def _post(url: str, body: dict[str, Any]) -> tuple[int, str, dict[str, Any]]:
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            return r.status, r.headers.get(REPLICA_HEADER, ""), await r.json()


def _texts(events: list[str]) -> list[str]:
    return [json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]" and
            "choices" in json.loads(e)]  # fmt: skip


@pytest.mark.parametrize("behaviour", ["die_mid_stream", "hang_mid_stream"])
def test_a_replica_failing_mid_stream_ends_it_with_an_error_and_leaves_rotation(
    fakes: tuple[FakeReplica, FakeReplica], behaviour: str
) -> None:
    """A replica that dies (connection reset) or goes silent (bounded by the router's
    ``read_timeout_s``) after its first events: the client gets those events, then an
    error event naming the replica and ``[DONE]``, never a hang; the replica leaves
    rotation and the next requests are answered by the other one."""
    a, b = fakes
    a.behaviour = behaviour
    proc, url = _router(f"{a.url},{b.url}", "--router-read-timeout-s", "1")
    try:
        for _ in range(2):  # round robin: until ``a`` answers
            status, replica, events = asyncio.run(_stream(url, {"prompt": "x"}))
            if replica == a.url:
                break
        assert status == 200 and replica == a.url
        assert _texts(events) == [f"t{i}" for i in range(EVENTS_BEFORE)], events
        assert events[-1] == "[DONE]", events
        err = json.loads(events[-2])["error"]
        assert err["type"] == "UpstreamError" and a.url in err["message"], err
        if behaviour == "hang_mid_stream":
            assert "timed out" in err["message"], err
        assert _healthy(url) == {a.url: False, b.url: True}
        for _ in range(3):
            status, replica, events = asyncio.run(_stream(url, {"prompt": "y"}))
            assert (status, replica, events[-1]) == (200, b.url, "[DONE]")
            assert _texts(events) == [f"t{i}" for i in range(b.events)]
        assert proc.alive()
    finally:
        proc.terminate()
    assert any("broke a stream mid-way" in line for line in proc.log), proc.log


def test_the_health_check_keeps_a_dead_replica_out_and_takes_it_back(
    fakes: tuple[FakeReplica, FakeReplica],
) -> None:
    """After dying mid-stream the replica fails its ``/health`` and stays out of
    rotation; once it answers again it is back in rotation."""
    a, b = fakes
    a.behaviour = "die_mid_stream"
    proc, url = _router(f"{a.url},{b.url}", "--router-health-interval-s", "0.2")
    try:
        for _ in range(2):
            _, replica, _ = asyncio.run(_stream(url, {"prompt": "x"}))
            if replica == a.url:
                break
        assert replica == a.url
        wait_for(lambda: _healthy(url)[a.url] is False, "a health round refused", 60)
        a.dead, a.behaviour = False, "ok"
        deadline = time.monotonic() + 60
        while not _healthy(url)[a.url]:
            assert time.monotonic() < deadline, _status(url)
            time.sleep(0.1)
        answered = {asyncio.run(_stream(url, {"prompt": "z"}))[1] for _ in range(4)}
        assert answered == {a.url, b.url}
    finally:
        proc.terminate()


@pytest.mark.parametrize("behaviour", ["reset", "hang"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_replica_failing_before_the_first_byte_is_retried_on_another(
    fakes: tuple[FakeReplica, FakeReplica], behaviour: str, stream: bool
) -> None:
    """A replica that resets the connection, or never answers (bounded by the router's
    ``request_timeout_s``), before any byte of its answer: the request is answered by the
    other replica (the client sees one clean answer), the first leaves rotation."""
    a, b = fakes
    a.behaviour = behaviour
    proc, url = _router(f"{a.url},{b.url}", "--router-request-timeout-s", "1")
    try:
        for i in range(2):  # round robin: one of the two requests goes to ``a`` first
            if stream:
                status, replica, events = asyncio.run(_stream(url, {"prompt": f"p{i}"}))
                assert _texts(events) == [f"t{j}" for j in range(b.events)], events
                assert events[-1] == "[DONE]"
            else:
                status, replica, body = asyncio.run(_post(url, {"prompt": f"p{i}"}))
                assert body["choices"][0]["text"] == "b", body
            assert (status, replica) == (200, b.url)
        assert len(a.bodies) == 1  # tried once, then out of rotation
        st = _status(url)
        assert {r["url"]: r["healthy"] for r in st["replicas"]} == {a.url: False, b.url: True}
        (ra,) = [r for r in st["replicas"] if r["url"] == a.url]
        assert ra["failures"] == 1 and ra["last_error"], ra
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            assert "pegaflow_router_retries_total 1.0" in r.read().decode()
    finally:
        proc.terminate()


def test_every_replica_failing_is_a_clear_503(fakes: tuple[FakeReplica, FakeReplica]) -> None:
    """Both replicas reset the connection: one OpenAI-style 503 naming both, no hang;
    the router serves on (its ``/v1/status`` says why each is out)."""
    a, b = fakes
    a.behaviour = b.behaviour = "reset"
    proc, url = _router(f"{a.url},{b.url}")
    try:
        status, _, body = asyncio.run(_post(url, {"prompt": "x"}))
        assert status == 503, body
        msg = body["error"]["message"]
        assert a.url in msg and b.url in msg and "/v1/status" in msg, msg
        status, _, _ = asyncio.run(_stream(url, {"prompt": "x"}))
        assert status == 503
        assert _healthy(url) == {a.url: False, b.url: False}
        assert proc.alive()
    finally:
        proc.terminate()


def test_a_stream_that_never_ends_is_bounded_by_the_request_deadline(
    fakes: tuple[FakeReplica, FakeReplica],
) -> None:
    """A replica dripping events forever: ``request_timeout_s`` ends the stream with an
    error event and ``[DONE]``; what came before it reached the client."""
    a = fakes[0]
    a.behaviour = "drip"
    proc, url = _router(a.url, "--router-request-timeout-s", "1.5")
    try:
        status, replica, events = asyncio.run(_stream(url, {"prompt": "x"}))
        assert (status, replica) == (200, a.url)
        assert len(_texts(events)) >= 2 and events[-1] == "[DONE]", events
        assert "timed out" in json.loads(events[-2])["error"]["message"], events[-2]
    finally:
        proc.terminate()


def test_a_client_leaving_mid_stream_closes_the_upstream_request(
    fakes: tuple[FakeReplica, FakeReplica],
) -> None:
    """The client drops its connection after the first events: the router closes the
    replica's request (vLLM then aborts it) and keeps the replica in rotation."""
    a = fakes[0]
    a.behaviour = "drip"
    proc, url = _router(a.url)

    async def leave() -> None:
        async with aiohttp.ClientSession() as s:
            r = await s.post(url + "/v1/completions", json={"prompt": "x", "stream": True})
            assert r.status == 200
            await r.content.readline()
            r.close()

    try:
        asyncio.run(leave())
        assert a.client_left.wait(30), "the replica's request stayed open"
        assert _healthy(url) == {a.url: True}
        a.behaviour = "ok"
        status, _, events = asyncio.run(_stream(url, {"prompt": "y"}))
        assert status == 200 and events[-1] == "[DONE]"
    finally:
        proc.terminate()


def test_pd_recomputes_on_the_decode_replica_when_the_prefill_replica_dies(
    fakes: tuple[FakeReplica, FakeReplica],
) -> None:
    """P/D: the prefill replica resets the connection: the decode replica gets the
    original request without ``kv_transfer_params`` and answers (``recompute``); the
    prefill replica leaves rotation.  A live prefill replica's params reach the decode
    replica (``handoff``)."""
    p, d = fakes
    p.behaviour = "reset"
    proc, url = _router(f"{p.url};role=prefill,{d.url};role=decode", "--router-mode", "pd")
    try:
        status, replica, events = asyncio.run(_stream(url, {"prompt": "x", "max_tokens": 9}))
        assert (status, replica, events[-1]) == (200, d.url, "[DONE]")
        assert p.bodies[0]["max_tokens"] == 1 and p.bodies[0]["stream"] is False
        assert d.bodies[0] == {"prompt": "x", "max_tokens": 9, "stream": True}
        assert _healthy(url) == {p.url: False, d.url: True}
        assert _status(url)["counters"] == {"recompute": 1}
        # a router that finds it healthy: the handoff goes through
        p.behaviour = "ok"
        proc.terminate()
        proc, url = _router(f"{p.url};role=prefill,{d.url};role=decode", "--router-mode", "pd")
        status, replica, _ = asyncio.run(_post(url, {"prompt": "x", "max_tokens": 9}))
        assert (status, replica) == (200, d.url)
        assert d.bodies[-1]["kv_transfer_params"] == {"from": "a"}
        assert _status(url)["counters"] == {"handoff": 1}
    finally:
        proc.terminate()
