"""The router's defects of issue 36 (items 11-14), each against a real ``pegaflow-router``
process in front of stand-in replicas (aiohttp apps: the thing under test is the
router): a replica that answers 500 while its ``/health`` says 200 is ejected and its
requests retried; a hung replica is bounded by the first-byte deadline and its failed
``/health``, a client leaving cancels the upstream request; answers are relayed, not
read whole; request bodies are bounded in memory; idle and trickling connections are
closed and file descriptors kept for serving; a deeply nested body is a 400, a stream
without ``[DONE]`` is visibly incomplete, ``Expect: 100-continue`` over the limit a 413.

New settings are given through the environment (``PEGAFLOW_ROUTER_<OPTION>``), which
a router without them ignores: so each test fails on the old router by what it does,
not by an unknown flag.  Figures (memory added, descriptors) are printed (``-s``) and
quoted in docs/reliability.md."""

from __future__ import annotations

import asyncio
import json
import socket
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

CLIENT_TIMEOUT_S = 60.0
"""the test client's own bound: far over every router deadline a test sets, so a test
that reaches it shows a hang"""
MiB = 1 << 20


def _event(i: int) -> bytes:
    chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f"t{i}"}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


class Replica:
    """A stand-in vLLM replica on a loop thread.  ``behaviour``:

    * ``ok``: answers (a stream: 3 events, then ``[DONE]``);
    * ``fail500``: a 500 at once, while ``/health`` answers 200;
    * ``hang``: never answers, nor its ``/health`` (a frozen process);
    * ``hang_quiet``: never answers a request, ``/health`` 200 (a stuck engine);
      ``client_left`` is set when the router closes such a request;
    * ``big``: a non-stream answer of ``answer_bytes``, written 1 MiB at a time;
    * ``no_done``: a stream that ends cleanly after its events, without ``[DONE]``.
    """

    def __init__(self, name: str, behaviour: str = "ok") -> None:
        self.name = name
        self.behaviour = behaviour
        self.answer_bytes = 0
        self.requests = 0
        self.client_left = threading.Event()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._release: asyncio.Event | None = None

    def start(self) -> Replica:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(10)
        return self

    async def _serve(self) -> None:
        self._release = asyncio.Event()
        app = web.Application(client_max_size=128 * MiB)
        app.router.add_get("/health", self._health)
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

    async def _health(self, _req: web.Request) -> web.Response:
        if self.behaviour == "hang":
            assert self._release is not None
            await self._release.wait()
        return web.Response(text="ok")

    async def _completion(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        self.requests += 1
        b = self.behaviour
        if b == "fail500":
            return web.json_response({"error": {"message": "engine dead"}}, status=500)
        if b in ("hang", "hang_quiet"):
            assert self._release is not None
            while not self._release.is_set():
                if req.transport is None or req.transport.is_closing():
                    self.client_left.set()
                    break
                await asyncio.sleep(0.05)
            return web.Response()
        if b == "big":
            out = web.StreamResponse(headers={"Content-Type": "application/json"})
            out.content_length = self.answer_bytes
            await out.prepare(req)
            block = b" " * MiB
            for _ in range(self.answer_bytes // MiB):
                await out.write(block)
            await out.write_eof()
            return out
        if not body.get("stream"):
            answer = {"object": "text_completion", "choices": [{"index": 0, "text": self.name}]}
            if body.get("max_tokens") == 1 and "kv_transfer_params" not in body:
                answer["kv_transfer_params"] = {"from": self.name}
            return web.json_response(answer)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(req)
        for i in range(3):
            await out.write(_event(i))
        if b != "no_done":
            await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


@pytest.fixture
def replicas() -> Iterator[list[Replica]]:
    """Replicas a test starts (append them): stopped when it ends."""
    started: list[Replica] = []
    yield started
    for r in started:
        r.stop()


def _replica(replicas: list[Replica], name: str, behaviour: str = "ok") -> Replica:
    r = Replica(name, behaviour).start()
    replicas.append(r)
    return r


def _router(
    replicas: str, *args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
) -> tuple[Proc, str]:
    """A ``pegaflow-router`` on a free port, health checks hourly unless ``args`` say
    otherwise, new settings in ``env`` (``{"first_byte_timeout_s": "1"}``)."""
    proc = start(
        "pegaflow-router",
        ["pegaflow.router.main", "--router-port", "0", "--router-health-interval-s", "3600",
         "--router-replicas", replicas, "--router-report-interval-s", "0", *args],
        env={f"PEGAFLOW_ROUTER_{k.upper()}": v for k, v in (env or {}).items()},
        prefix=prefix,
    )  # fmt: skip
    return proc, "http://" + proc.ready["address"]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _status(url: str) -> dict[str, Any]:
    return json.loads(_get(url + "/v1/status"))


def _healthy(url: str) -> dict[str, bool]:
    return {r["url"]: r["healthy"] for r in _status(url)["replicas"]}


async def _request(url: str, body: dict[str, Any]) -> tuple[int, str, list[str] | dict[str, Any]]:
    """POST a completion: (status, the answering replica, the stream's event data or
    the JSON answer)."""
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            if body.get("stream") and r.status == 200:
                events = []
                async for line in r.content:
                    text = line.decode().strip()
                    if text.startswith("data: "):
                        events.append(text[len("data: ") :])
                return r.status, r.headers.get(REPLICA_HEADER, ""), events
            return r.status, r.headers.get(REPLICA_HEADER, ""), await r.json()


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM), bytes."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _fds(pid: int) -> int:
    import os

    return len(os.listdir(f"/proc/{pid}/fd"))


# ---- 11: a replica that fails its answers while /health says 200 ---------------------


@pytest.mark.parametrize("mode", ["cache", "pd"])
def test_a_replica_answering_500_with_a_healthy_health_is_ejected_and_retried(
    replicas: list[Replica], mode: str
) -> None:
    """Replica ``a`` answers every request 500 at once, its ``/health`` 200; least
    loaded routing (cache mode without a namespace, pd's decode) sends it the most (it
    has nothing in flight).  Every request is answered by ``b`` (retried after ``a``'s
    500); after ``eject_after`` (3) failed answers ``a`` is out of rotation
    (``/v1/status``: not healthy, ``ejected_s`` left) whatever its ``/health`` says, and
    gets no more requests."""
    a, b = _replica(replicas, "a", "fail500"), _replica(replicas, "b")
    if mode == "pd":
        p = _replica(replicas, "p")
        spec = f"{p.url};role=prefill,{a.url};role=decode,{b.url};role=decode"
    else:
        spec = f"{a.url},{b.url}"
    proc, url = _router(spec, "--router-mode", mode, "--router-health-interval-s", "0.2")

    async def burst(n: int) -> list[tuple[int, str]]:
        got = await asyncio.gather(
            *(_request(url, {"prompt": f"p{i}", "stream": bool(i % 2)}) for i in range(n))
        )
        for status, _, answer in got:
            assert status != 200 or not isinstance(answer, list) or answer[-1] == "[DONE]"
        return [(status, replica) for status, replica, _ in got]

    try:
        assert asyncio.run(burst(12)) == [(200, b.url)] * 12
        sent = a.requests
        print(f"\n{mode}: the failing replica drew {sent} of 12 requests, then none")
        assert sent >= 3, sent  # least loaded: ``a``, idle, drew requests
        (ra,) = [r for r in _status(url)["replicas"] if r["url"] == a.url]
        assert ra["healthy"] is False and ra["ejected_s"] > 0, ra
        assert "500" in ra["last_error"], ra
        time.sleep(0.5)  # health rounds: its /health answers 200, it stays out
        for _ in range(2):
            assert asyncio.run(burst(6)) == [(200, b.url)] * 6
        assert a.requests == sent
        assert any("failed answers in a row" in line for line in proc.log), proc.log
    finally:
        proc.terminate()


def test_an_ejected_replica_gets_one_trial_request_then_returns_or_stays_out(
    replicas: list[Replica],
) -> None:
    """After ``eject_s`` an ejected replica gets one trial request: failing, it is
    retried elsewhere and the replica is out again for twice as long; answering, it is
    back in rotation."""
    a, b = _replica(replicas, "a", "fail500"), _replica(replicas, "b")
    env = {"eject_after": "1", "eject_s": "0.5"}
    proc, url = _router(f"{a.url},{b.url}", env=env)
    try:
        assert asyncio.run(_request(url, {"prompt": "x"}))[:2] == (200, b.url)
        assert a.requests == 1 and _healthy(url) == {a.url: False, b.url: True}
        time.sleep(0.6)  # the ejection ends: a trial, which fails
        for _ in range(2):
            assert asyncio.run(_request(url, {"prompt": "y"}))[:2] == (200, b.url)
        assert a.requests == 2
        (ra,) = [r for r in _status(url)["replicas"] if r["url"] == a.url]
        assert 0.5 < ra["ejected_s"] <= 1.0, ra  # doubled
        a.behaviour = "ok"
        time.sleep(1.1)
        answered = {asyncio.run(_request(url, {"prompt": f"z{i}"}))[1] for i in range(4)}
        assert answered == {a.url, b.url}
        assert _healthy(url) == {a.url: True, b.url: True}
    finally:
        proc.terminate()


# ---- 12: hung replicas and clients that leave ---------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_to_a_hung_replica_is_retried_before_the_request_deadline(
    replicas: list[Replica], stream: bool
) -> None:
    """Replica ``a`` freezes (no answer, no ``/health``) with the request already sent;
    ``request_timeout_s`` is its default (30 minutes).  A stream is retried on ``b``
    after ``first_byte_timeout_s``; a plain request (whose first byte is the end of its
    generation) when ``a`` fails its ``/health``."""
    a, b = _replica(replicas, "a"), _replica(replicas, "b")
    args = ["--router-health-timeout-s", "0.5"]
    if not stream:
        args += ["--router-health-interval-s", "0.3"]
    proc, url = _router(f"{a.url},{b.url}", *args, env={"first_byte_timeout_s": "1"})
    a.behaviour = "hang"  # after the router found it healthy; round robin: ``a`` first
    try:
        t0 = time.monotonic()
        status, replica, got = asyncio.run(_request(url, {"prompt": "x", "stream": stream}))
        took = time.monotonic() - t0
        print(f"\nhung replica, stream={stream}: answered by the other in {took:.1f} s")
        assert (status, replica) == (200, b.url), got
        assert a.requests == 1
        assert _healthy(url)[a.url] is False
    finally:
        proc.terminate()


def test_a_client_leaving_before_the_first_byte_closes_the_upstream_request(
    replicas: list[Replica],
) -> None:
    """A stuck replica (``/health`` 200) holds a request; its client goes away: the
    router closes the upstream request at once (vLLM aborts it), not after
    ``request_timeout_s``."""
    a = _replica(replicas, "a", "hang_quiet")
    proc, url = _router(a.url)

    async def leave() -> None:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(url + "/v1/completions", json={"prompt": "x"}))
            await asyncio.sleep(1.0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(leave())
        assert a.client_left.wait(30), "the replica's request stayed open"
        assert _healthy(url) == {a.url: True}
    finally:
        proc.terminate()


# ---- 13: memory and connections -----------------------------------------------------


def test_a_large_answer_is_relayed_not_read_whole(replicas: list[Replica]) -> None:
    """A 256 MiB answer: the router relays it chunk by chunk (its peak memory grows by
    far less than the answer; reading it whole added more than the answer)."""
    a = _replica(replicas, "a", "big")
    a.answer_bytes = 256 * MiB
    proc, url = _router(a.url)

    async def fetch() -> int:
        n = 0
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
                async for chunk in r.content.iter_any():
                    n += len(chunk)
        return n

    try:
        before = _peak_rss(proc.pid)
        assert asyncio.run(fetch()) == a.answer_bytes
        added = _peak_rss(proc.pid) - before
        print(f"\n256 MiB answer: router peak memory +{added / MiB:.0f} MiB")
        assert added < 64 * MiB, added
    finally:
        proc.terminate()


def test_concurrent_large_bodies_are_bounded_and_parsed_off_the_loop(
    replicas: list[Replica],
) -> None:
    """8 concurrent 24 MiB bodies under ``max_body_inflight_bytes`` 48 MiB: at most two
    are held at once, so the router's peak memory grows by a fraction of what 8 would
    take; all are answered, and ``/health`` answers meanwhile."""
    a = _replica(replicas, "a")
    proc, url = _router(a.url, env={"max_body_inflight_bytes": "48MiB"})
    prompt = "x" * (24 * MiB)

    async def flood() -> tuple[list[int], float]:
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as s:

            async def one() -> int:
                async with s.post(url + "/v1/completions", json={"prompt": prompt}) as r:
                    await r.read()
                    return r.status

            async def health() -> float:
                worst = 0.0
                for _ in range(20):
                    t0 = time.monotonic()
                    async with s.get(url + "/health") as r:
                        await r.read()
                    worst = max(worst, time.monotonic() - t0)
                    await asyncio.sleep(0.05)
                return worst

            *statuses, worst = await asyncio.gather(*(one() for _ in range(8)), health())
        return statuses, worst

    try:
        before = _peak_rss(proc.pid)
        statuses, worst = asyncio.run(flood())
        added = _peak_rss(proc.pid) - before
        print(f"\n8 x 24 MiB bodies: router peak memory +{added / MiB:.0f} MiB, "
              f"slowest /health meanwhile {worst * 1000:.0f} ms")  # fmt: skip
        assert statuses == [200] * 8
        assert added < 8 * 24 * MiB, added
        assert _status(url)["router"]["body_bytes_held"] == 0
    finally:
        proc.terminate()


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def _closed_by_peer(s: socket.socket, within: float) -> bool:
    """Whether the peer closes ``s`` within ``within`` seconds (reading what it sent)."""
    s.settimeout(within)
    try:
        while s.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


def test_idle_and_trickling_connections_are_closed_and_descriptors_kept_for_serving(
    replicas: list[Replica],
) -> None:
    """A router with a 1,024 descriptor limit and 1,100 idle connections: those past
    ``max_connections`` (from the limit) get a 503 and are closed, a new client gets a
    prompt answer (a 503 while the slots are full, never a failed or hung connect), the
    idle ones are closed after ``idle_timeout_s`` and then requests are served.  A
    client trickling its headers is closed as idle; one trickling its body gets a 408
    after ``body_timeout_s``."""
    a = _replica(replicas, "a")
    env = {"idle_timeout_s": "2", "body_timeout_s": "1"}
    proc, url = _router(a.url, env=env, prefix=("prlimit", "--nofile=1024:1024"))
    port = int(url.rsplit(":", 1)[1])
    idle: list[socket.socket] = []
    try:
        for _ in range(1100):
            idle.append(_connect(port))
        time.sleep(0.5)
        fds = _fds(proc.pid)
        status, _, body = asyncio.run(_request(url, {"prompt": "x"}))
        print(f"\n1,100 idle connections: router holds {fds} descriptors; a new request: "
              f"{status}")  # fmt: skip
        assert status in (200, 503), body
        if status == 503:
            assert "connections at once" in body["error"]["message"], body  # type: ignore[call-overload]
        assert fds < 1024 - 32, fds
        t0 = time.monotonic()
        assert all(_closed_by_peer(s, 10) for s in idle)
        print(f"idle connections all closed {time.monotonic() - t0:.1f} s later")
        assert asyncio.run(_request(url, {"prompt": "y"}))[0] == 200
        assert proc.alive()

        trickle = _connect(port)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        t0 = time.monotonic()
        closed = False
        for i in range(60):  # a byte every 0.1 s: 6 s, far over idle_timeout_s
            try:
                trickle.sendall(head[i % len(head) : i % len(head) + 1])
            except OSError:
                closed = True
                break
            time.sleep(0.1)
        closed = closed or _closed_by_peer(trickle, 5)
        assert closed, "a client trickling its headers was kept"
        assert time.monotonic() - t0 < 10

        slow = _connect(port)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{")  # fmt: skip
        slow.settimeout(CLIENT_TIMEOUT_S)
        for _ in range(30):
            time.sleep(0.1)
            try:
                slow.sendall(b" ")
            except OSError:
                break
        answer = slow.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer
    finally:
        for s in idle:
            s.close()
        proc.terminate()


# ---- 14: malformed bodies, truncated streams, Expect ---------------------------------


def test_a_deeply_nested_body_is_a_400(replicas: list[Replica]) -> None:
    """A body nested 100,000 deep (and one nested just under what the parser takes):
    a 400 naming the problem, not a 500."""
    a = _replica(replicas, "a")
    proc, url = _router(a.url)
    try:
        for body in (b"[" * 100_000 + b"]" * 100_000,
                     b'{"prompt": "x", "extra": ' + b"[" * 990 + b"]" * 990 + b"}"):  # fmt: skip
            req = urllib.request.Request(url + "/v1/completions", data=body, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    status, text = r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                status, text = e.code, e.read().decode()
            if status == 200:  # the shallower one may be taken whole; fine
                continue
            assert status == 400, (status, text)
            assert "nested too deeply" in json.loads(text)["error"]["message"], text
        assert proc.alive()
    finally:
        proc.terminate()


def test_a_stream_ending_without_done_is_visibly_incomplete(replicas: list[Replica]) -> None:
    """A replica's stream ends cleanly but without ``data: [DONE]``: the client gets its
    events, then an error event saying so (never a stream that looks complete), and the
    router counts it (``outcome="truncated"``)."""
    a = _replica(replicas, "a", "no_done")
    proc, url = _router(a.url)
    try:
        status, replica, events = asyncio.run(_request(url, {"prompt": "x", "stream": True}))
        assert (status, replica) == (200, a.url)
        assert isinstance(events, list) and len(events) == 5, events
        err = json.loads(events[-2])["error"]
        assert "without data: [DONE]" in err["message"], err
        metrics = _get(url + "/metrics")
        assert f'outcome="truncated",replica="{a.url}"' in metrics or (
            f'replica="{a.url}",outcome="truncated"' in metrics
        ), metrics
    finally:
        proc.terminate()


@pytest.mark.parametrize("expect", [True, False])
def test_a_body_over_the_limit_is_a_413_before_it_is_sent(
    replicas: list[Replica], expect: bool
) -> None:
    """A 1 GB body announced with ``Expect: 100-continue`` (limit 64 MiB): a 413 at
    once, never ``100 Continue``; without ``Expect``, a 413 before any of it is read."""
    a = _replica(replicas, "a")
    proc, url = _router(a.url)
    port = int(url.rsplit(":", 1)[1])
    try:
        s = _connect(port)
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: 1000000000\r\n")  # fmt: skip
        s.sendall(head + (b"Expect: 100-continue\r\n" if expect else b"") + b"\r\n")
        s.settimeout(CLIENT_TIMEOUT_S)
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413"), answer
        assert b"max-body-bytes" in answer or _closed_by_peer(s, 10), answer
        s.close()
        assert a.requests == 0 and proc.alive()
    finally:
        proc.terminate()


# ---- 36, found by scripts/chaos_router.py: every replica of a role ejected -------------


@pytest.mark.parametrize("mode", ["cache", "pd"])
def test_ejection_never_leaves_a_role_without_a_replica_whose_health_answers(
    replicas: list[Replica], mode: str
) -> None:
    """Both replicas of a role failed their answers and were ejected (``eject_s`` 60),
    then recovered; their ``/health`` answers 200 all along.  Requests go to them (the
    least loaded ejected one) rather than a 503 "no healthy replica" for the whole
    ejection, which is what the chaos run saw: a replica whose fault had ended still
    ejected while the other one was, 883 requests answered 503 in 2.3 s.  The first
    answer puts its replica back in rotation; a replica failing its ``/health`` is still
    never used."""
    a, b = _replica(replicas, "a", "fail500"), _replica(replicas, "b", "fail500")
    if mode == "pd":
        p = _replica(replicas, "p")
        spec = f"{p.url};role=prefill,{a.url};role=decode,{b.url};role=decode"
    else:
        spec = f"{a.url},{b.url}"
    env = {"eject_after": "1", "eject_s": "60"}
    proc, url = _router(spec, "--router-mode", mode, "--router-health-interval-s", "0.2", env=env)
    try:
        status, _, _ = asyncio.run(_request(url, {"prompt": "x"}))
        assert status == 500 and a.requests == b.requests == 1  # tried on both, both out
        st = {r["url"]: r for r in _status(url)["replicas"]}
        assert st[a.url]["ejected_s"] > 50 and st[b.url]["ejected_s"] > 50, st
        a.behaviour = b.behaviour = "ok"
        time.sleep(0.5)  # health rounds: both answer 200, both still ejected
        status, replica, answer = asyncio.run(_request(url, {"prompt": "y", "stream": True}))
        assert status == 200 and replica in (a.url, b.url), answer
        assert isinstance(answer, list) and answer[-1] == "[DONE]", answer
        assert _healthy(url)[replica] is True  # its answer ended its ejection
        got = [asyncio.run(_request(url, {"prompt": f"z{i}"}))[:2] for i in range(4)]
        assert all(s == 200 for s, _ in got), got
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
        a.behaviour = b.behaviour = "hang"  # /health hangs too: out, never used
        time.sleep(3.0)  # a health round times out (2 s)
        assert asyncio.run(_request(url, {"prompt": "w"}))[0] == 503
    finally:
        a.behaviour = b.behaviour = "ok"
        proc.terminate()


class _Dripping(Replica):
    """A :class:`Replica` whose streams, while its ``behaviour`` is ``ok`` as they
    start, send 5 events ``drip_s`` apart (a long answer under way) whatever the
    behaviour becomes meanwhile."""

    drip_s = 0.3

    async def _completion(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        if self.behaviour != "ok" or not body.get("stream"):
            return await super()._completion(req)  # the body is cached: read again
        self.requests += 1
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(req)
        for i in range(5):
            await out.write(_event(i))
            await asyncio.sleep(self.drip_s)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def test_an_answer_sent_before_an_ejection_does_not_end_it(replicas: list[Replica]) -> None:
    """Replica ``a`` is streaming a long answer when it starts answering 500 at once
    (its ``/health`` 200): its next request fails and ejects it (``eject_after`` 1,
    ``eject_s`` 60).  The long answer then ends well; it was sent before the ejection,
    so it is no trial and ``a`` stays out.  It used to put ``a`` back at once (the
    chaos run's ``fail_fast`` replicas drew a new round of failures each time a stream
    they had started before failing ended)."""
    a = _Dripping("a").start()
    replicas.append(a)
    b = _replica(replicas, "b")
    proc, url = _router(f"{a.url},{b.url}", env={"eject_after": "1", "eject_s": "60"})

    async def scenario() -> tuple[int, str, Any]:
        long = asyncio.create_task(_request(url, {"prompt": "long", "stream": True}))
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while a.requests < 1:  # round robin: ``a`` first
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        a.behaviour = "fail500"
        while a.requests < 2:  # round robin: every other request tries ``a`` first
            assert (await _request(url, {"prompt": "x"}))[:2] == (200, b.url)
        (ra,) = [r for r in _status(url)["replicas"] if r["url"] == a.url]
        assert ra["ejected_s"] > 50, ra
        return await long

    try:
        status, replica, events = asyncio.run(scenario())
        assert (status, replica) == (200, a.url) and events[-1] == "[DONE]", events
        assert len(events) == 6, events  # 5 events, [DONE]: the long answer ended well
        (ra,) = [r for r in _status(url)["replicas"] if r["url"] == a.url]
        assert ra["healthy"] is False and ra["ejected_s"] > 50, ra
        for i in range(4):
            assert asyncio.run(_request(url, {"prompt": f"y{i}"}))[:2] == (200, b.url)
        assert a.requests == 2
    finally:
        proc.terminate()
