#!/usr/bin/env python3
"""Router chaos: a real ``pegaflow-router`` under load while its replicas fail at random.

On this machine only (127.0.0.1): ``--replicas`` stand-in OpenAI servers
(``scripts/chaos_replica.py``), each a real HTTP server in its own process
(``/health``, ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``,
streamed or not; every answer derived from its request, so every answer is checked),
a real ``pegaflow-router`` in front of them (``--mode
cache``: routed by load and recent prompts, token-id prompts hashed; ``pd``: half of
the replicas prefill, half decode, the handoff's ``kv_transfer_params`` checked by the
decode replica; ``both``: one run of each), and ``--clients`` closed-loop client tasks
(aiohttp) sending completions and chats, streamed and plain, conversations growing turn
by turn.

Meanwhile, every 1-4 s, a random replica is faulted for 0.5-4 s:

* ``fail_fast``: every request answered 500 at once, ``/health`` 200 (a dead engine
  behind a live API server);
* ``hang``: answers stop where they are (before the first byte, or mid-way) and resume
  at the end; ``/health`` hangs too (a frozen process) or answers 200 (a stuck engine);
* ``kill``: SIGKILL, then a restart after 0-1.5 s on the same port;
* ``slow``: 0.2-1.5 s to the first byte, 50-300 ms a token;
* ``truncate``: a stream ends without ``data: [DONE]`` (cleanly, or the connection cut),
  a plain answer is cut off mid-body.

At most one fault per replica at a time, and at least one replica of each role left
alone.  The last ``--cooldown`` seconds have no faults.

Checks (exit 1 when one fails):

* **wrong answers**: 0.  An answer relayed as complete (200 with a whole body, or a
  stream with ``[DONE]`` and no error event) whose text differs from what any replica
  gives for that request, or a stream that ends without ``[DONE]`` and without an error
  event (a client takes that for the end of the answer);
* **no error clear of faults**: every request sent once the last fault ended succeeds,
  and so does every request clear of all faults (sent ``SETTLE_S``, 1.5 s, a health
  round, or more after one ended, and answered before the next began);
* **no refusal**: no 5xx from the router (nothing relayed) while a replica of the role
  could serve all along (not faulted but ``slow``, and ``SETTLE_S`` past a fault that
  takes its ``/health`` down) and fewer than ``retries + 1`` could not;
* **no hang**: no request outlives the client's own bound (``CLIENT_TIMEOUT_S``);
* **ejection**: a ``fail_fast`` replica draws at most ``eject_after`` requests, plus
  one per client (in flight meanwhile) and one trial per ``eject_s`` of the fault,
  unless every other replica of its role was out of rotation meanwhile (the router then
  sends to ejected ones); one faulted for 1.5 s or more was seen out of rotation (the
  router's ``/v1/status``, sampled every 0.25 s);
* the router never dies, and no replica stays out of rotation with no reason at the end.

Reported: client-visible errors by kind (``http_<status>``, ``stream_error``: a stream
the router ended with an error event, ``broken``: a cut connection), by phase
(``fault``: the request overlapped a fault or the 1.5 s after it, ``between``,
``cooldown``) and by the kinds of the faults it overlapped; the share of the requests
sent during ``fail_fast`` faults that their replica drew; per fault, the requests its
target drew, the time it took to leave rotation, to be back in rotation, and to serve
again through the router (its first good answer to a request sent after the fault
ended and before the next fault on it; ``refaulted`` when none came before that);
latency; handoffs and recomputes (``pd``).

A line per fault goes to stderr; the last line of stdout is one JSON object.  Exit
status: 0 when the checks hold, 1 otherwise, 2 when a replica or the router cannot
start, 130 on Ctrl-C; every process is cleaned up.

    .venv/bin/python scripts/chaos_router.py --mode both --minutes 2 --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pegaflow.router.proxy import REPLICA_HEADER  # noqa: E402

from pegaflow.tools.devcluster import Proc, free_port, start  # noqa: E402
from scripts import _common  # noqa: E402
from scripts._common import log  # noqa: E402
from scripts.chaos_replica import CHAT, COMPLETIONS, answer_pieces, piece_of  # noqa: E402

FAULTS = ("fail_fast", "hang", "kill", "slow", "truncate")
MODES = ("cache", "pd")
ROUTER = {
    "health-interval-s": 0.5,
    "health-timeout-s": 1.0,
    "connect-timeout-s": 2.0,
    "first-byte-timeout-s": 3.0,
    "read-timeout-s": 3.0,
    "request-timeout-s": 15.0,
    "prefill-timeout-s": 5.0,
    "eject-after": 3,
    "eject-s": 2.0,
    "retries": 2,
}
"""the router's settings (``--router-<name>``): deadlines a chaos run can outlive"""
CLIENT_TIMEOUT_S = 60.0
"""the clients' own bound, far over the router's: a request that reaches it hung"""
EJECT_WITHIN_S = 1.5
"""a fail_fast fault at least this long must show its replica out of rotation"""
RESTART_FOR_S = 15.0
STATUS_EVERY_S = 0.25
SETTLE_S = float(ROUTER["health-interval-s"]) + float(ROUTER["health-timeout-s"])
"""after a fault, the longest the router may take to see its replica's /health answer"""
DOWNING = ("kill", "hang", "truncate")
"""faults that take a replica's /health down, or the router's view of it (a connection
cut or a deadline marks it down until its next /health)"""


# ---- orchestrator -----------------------------------------------------------------


@dataclass
class Target:
    """A replica as the orchestrator sees it."""

    name: str
    port: int
    role: str
    proc: Proc | None = None
    faulted: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spec(self) -> str:
        return self.url + ("" if self.role == "both" else f";role={self.role}")


@dataclass
class Fault:
    kind: str
    target: str
    start: float
    hold_s: float
    params: dict[str, Any] = field(default_factory=dict)
    end: float = 0.0
    drew: int | None = None
    restart_error: str = ""


@dataclass
class Rec:
    """One client request and what came of it (``outcome``: ``ok``, an error kind, or
    ``wrong:<why>``)."""

    t0: float
    t1: float
    endpoint: str
    stream: bool
    outcome: str
    replica: str = ""
    kv_from: str = ""
    detail: str = ""


class Run:
    """One mode's run: replicas, the router, clients, faults, then the report."""

    def __init__(self, args: argparse.Namespace, mode: str, seed: int) -> None:
        self.args = args
        self.mode = mode
        self.seed = seed
        self.rng = random.Random(seed)
        n = max(2, args.replicas)
        if mode == "pd":
            n = max(4, n)
            roles = ["prefill"] * (n // 2) + ["decode"] * (n - n // 2)
        else:
            roles = ["both"] * n
        self.targets = {f"r{i + 1}": Target(f"r{i + 1}", free_port(), roles[i]) for i in range(n)}
        self.router: Proc | None = None
        self.url = ""
        self.pids: list[int] = []
        self.records: list[Rec] = []
        self.faults: list[Fault] = []
        self.samples: list[tuple[float, dict[str, tuple[bool, float]]]] = []
        self.t0 = 0.0
        self.quiet_from = 0.0
        self.cooldown_from = 0.0
        self.load_end = 0.0
        self.final_status: dict[str, Any] = {}
        self.stuck_out: list[str] = []
        self.router_died = ""
        self.error = ""

    def rel(self, t: float) -> float:
        return round(t - self.t0, 3)

    # -- processes --------------------------------------------------------------------

    def _start_replica(self, t: Target) -> None:
        t.proc = start(
            f"replica-{t.name}",
            ["scripts.chaos_replica", "--name", t.name, "--port", str(t.port)],
            timeout=30,
        )
        self.pids.append(t.proc.pid)

    def start(self) -> None:
        """Every replica, then the router; RuntimeError when one does not come up."""
        for t in self.targets.values():
            self._start_replica(t)
        spec = ",".join(t.spec for t in self.targets.values())
        flags = [x for k, v in ROUTER.items() for x in (f"--router-{k}", str(v))]
        argv = ["pegaflow.router.main", "--router-host", "127.0.0.1", "--router-port", "0",
                "--router-mode", self.mode, "--router-replicas", spec,
                "--router-report-interval-s", "0", *flags]  # fmt: skip
        self.router = start("pegaflow-router", argv, timeout=60)
        self.pids.append(self.router.pid)
        self.url = "http://" + self.router.ready["address"]

    def cleanup(self) -> None:
        """Every process of the run stopped (killed if it does not stop at once)."""
        for t in self.targets.values():
            if t.proc is not None:
                with contextlib.suppress(Exception):
                    t.proc.kill()
        if self.router is not None:
            with contextlib.suppress(Exception):
                self.router.terminate(timeout=5)

    # -- the run ----------------------------------------------------------------------

    async def run(self) -> None:
        total = self.args.minutes * 60
        cooldown = _common.cooldown_s(self.args, total, most_s=15)
        async with aiohttp.ClientSession() as control:
            await self._wait_in_rotation(control, 30)
            self.t0 = time.monotonic()
            self.quiet_from = self.t0 + max(0.0, total - cooldown)
            self.load_end = self.t0 + total
            stop = asyncio.Event()
            poller = asyncio.create_task(self._poll_status(control, stop))
            clients = [asyncio.create_task(self._client(i)) for i in range(self.args.clients)]
            faults = await self._fault_loop(control)
            self.cooldown_from = max([self.quiet_from, *(f.end for f in faults)])
            await asyncio.gather(*clients)
            await self._check_rotation_at_end(control)
            stop.set()
            await poller
        if self.router is not None and not self.router.alive():
            self.router_died = f"rc {self.router.popen.returncode}"

    async def _wait_in_rotation(self, s: aiohttp.ClientSession, within: float) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            st = await self._status(s)
            if st and all(r["healthy"] for r in st["replicas"]):
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"replicas not all in rotation within {within} s")

    async def _status(self, s: aiohttp.ClientSession) -> dict[str, Any]:
        try:
            async with s.get(self.url + "/v1/status", timeout=aiohttp.ClientTimeout(2)) as r:
                return dict(await r.json())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return {}

    async def _poll_status(self, s: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            st = await self._status(s)
            if st:
                seen = {
                    r["url"]: (bool(r["healthy"]), float(r["ejected_s"])) for r in st["replicas"]
                }
                self.samples.append((time.monotonic(), seen))
                self.final_status = st
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), STATUS_EVERY_S)

    async def _check_rotation_at_end(self, s: aiohttp.ClientSession) -> None:
        """A replica out of rotation at the end with no ejection time left: its
        ``/health`` answers, so it must come back within a few health rounds."""
        wait = 4 * float(ROUTER["health-interval-s"]) + float(ROUTER["health-timeout-s"])
        deadline = time.monotonic() + wait
        while True:
            st = await self._status(s)
            out = [
                r["url"] for r in st.get("replicas", []) if not r["healthy"] and not r["ejected_s"]
            ]
            if not out or time.monotonic() > deadline:
                self.stuck_out = out if st else ["(no /v1/status)"]
                return
            await asyncio.sleep(0.2)

    # -- load -------------------------------------------------------------------------

    def _request(self, rng: random.Random, conv: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The next request of one client's conversation (a new one every 3-8 turns)."""
        if conv.get("left", 0) <= 0:
            chat = rng.random() < 0.4
            conv.clear()
            conv.update(chat=chat, left=rng.randint(3, 8), tokens=[], messages=[])
        conv["left"] -= 1
        body: dict[str, Any] = {
            "model": "chaos",
            "max_tokens": rng.randint(4, 24),
            "stream": rng.random() < 0.6,
        }
        if conv["chat"]:
            msgs = conv["messages"]
            msgs.append({"role": "user", "content": f"q{rng.randrange(1 << 30)}"})
            body["messages"] = list(msgs)
            msgs.append({"role": "assistant", "content": f"a{rng.randrange(1 << 30)}"})
            return CHAT, body
        toks = conv["tokens"]  # token ids: cache mode hashes them (affinity)
        toks.extend(rng.randrange(50_000) for _ in range(rng.randint(8, 40)))
        body["prompt"] = list(toks)
        return COMPLETIONS, body

    async def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        conv: dict[str, Any] = {}
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            while time.monotonic() < self.load_end:
                endpoint, body = self._request(rng, conv)
                self.records.append(await self._one(s, endpoint, body))

    async def _one(self, s: aiohttp.ClientSession, endpoint: str, body: dict[str, Any]) -> Rec:
        """Send one request and judge its answer."""
        stream = bool(body["stream"])
        rec = Rec(time.monotonic(), 0.0, endpoint, stream, "ok")
        want = "".join(answer_pieces(endpoint, body))
        try:
            async with s.post(self.url + endpoint, json=body) as r:
                rec.replica = r.headers.get(REPLICA_HEADER, "")
                if r.status != 200:
                    rec.outcome = f"http_{r.status}"
                    rec.detail = (await r.text())[:200]
                elif stream:
                    await self._judge_stream(r, rec, want)
                else:
                    data = await r.read()  # a cut answer raises (short body)
                    try:
                        answer = json.loads(data)
                        got = piece_of(answer)
                        rec.kv_from = answer.get("chaos", {}).get("kv_from", "")
                    except (ValueError, AttributeError):
                        rec.outcome, rec.detail = "wrong:bad_body", data[:200].decode("replace")
                    else:
                        if got != want:
                            rec.outcome, rec.detail = "wrong:text", f"{got[:80]!r} != {want[:80]!r}"
        except TimeoutError:
            rec.outcome = "client_timeout"
        except aiohttp.ClientConnectorError as e:
            rec.outcome, rec.detail = "connect", str(e)[:200]
        except (aiohttp.ClientError, OSError) as e:
            rec.outcome, rec.detail = "broken", f"{type(e).__name__}: {e}"[:200]
        rec.t1 = time.monotonic()
        return rec

    async def _judge_stream(self, r: aiohttp.ClientResponse, rec: Rec, want: str) -> None:
        pieces: list[str] = []
        done = error = False
        async for line in r.content:
            text = line.decode().strip()
            if not text.startswith("data: ") or done:
                continue
            data = text[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            try:
                ev = json.loads(data)
                ev.get("error")
            except (ValueError, AttributeError):
                rec.outcome, rec.detail = "wrong:bad_event", data[:200]
                return
            if "error" in ev:
                error = True
                rec.detail = str(ev["error"].get("message", ""))[:200]
                continue
            pieces.append(piece_of(ev))
            rec.kv_from = ev.get("chaos", {}).get("kv_from", "") or rec.kv_from
        got = "".join(pieces)
        if error:
            rec.outcome = "stream_error"
        elif not done:
            rec.outcome = "wrong:unmarked_truncation"
            rec.detail = f"{len(pieces)} events, then the end without [DONE] nor an error"
        elif got != want:
            rec.outcome, rec.detail = "wrong:text", f"{got[:80]!r} != {want[:80]!r}"

    # -- faults -----------------------------------------------------------------------

    def _pick(self) -> Target | None:
        """A replica not faulted now whose role keeps another replica unfaulted (one
        draw whatever the choice: the schedule of kinds depends on the seed alone)."""
        free = [t for t in self.targets.values() if not t.faulted]
        ok = [t for t in free if sum(u.role == t.role for u in free) > 1]
        i = self.rng.randrange(1 << 30)
        return ok[i % len(ok)] if ok else None

    async def _fault_loop(self, s: aiohttp.ClientSession) -> list[Fault]:
        running: list[asyncio.Task[None]] = []
        kinds = [k for k in self.args.faults.split(",") if k]
        while True:
            await asyncio.sleep(self.rng.uniform(1.0, 4.0))
            now = time.monotonic()
            if now + 0.5 > self.quiet_from:
                break
            kind = self.rng.choice(kinds)
            f = Fault(kind, "", now, min(self.rng.uniform(0.5, 4.0), self.quiet_from - now))
            if kind == "hang":
                f.params["health"] = self.rng.choice(["hung", "ok"])
            elif kind == "slow":
                f.params.update(
                    first_s=round(self.rng.uniform(0.2, 1.5), 2),
                    pace_s=round(self.rng.uniform(0.05, 0.3), 3),
                )
            elif kind == "kill":
                f.hold_s = min(self.rng.uniform(0.0, 1.5), max(0.0, self.quiet_from - now))
            t = self._pick()
            if t is None:
                continue
            f.target = t.name
            self.faults.append(f)
            t.faulted = True
            running.append(asyncio.create_task(self._apply(s, t, f)))
        await asyncio.gather(*running)
        return self.faults

    async def _apply(self, s: aiohttp.ClientSession, t: Target, f: Fault) -> None:
        try:
            await self._fault(s, t, f)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError) as e:
            self.error = f"fault {f.kind} on {t.name} could not be applied: {e!r}"[:300]
            log(self.error)
        finally:
            f.end = time.monotonic()
            t.faulted = False
        what = {"kill": f"SIGKILL, restarted after {f.hold_s:.2f} s"}.get(
            f.kind, f"for {f.hold_s:.2f} s"
        )
        params = " ".join(f"{k}={v}" for k, v in f.params.items())
        drew = "" if f.drew is None else f", drew {f.drew} requests"
        err = f", restart failed: {f.restart_error}" if f.restart_error else ""
        log(
            f"[{self.rel(f.start):7.2f} s] {self.mode}: {f.kind} {t.name} ({t.role}) {what}"
            f"{' ' + params if params else ''}{drew}{err}"
        )

    async def _fault(self, s: aiohttp.ClientSession, t: Target, f: Fault) -> None:
        """Apply ``f`` to ``t`` and end it (``hold_s`` later)."""
        if f.kind == "kill":
            assert t.proc is not None
            await asyncio.to_thread(t.proc.kill)
            await asyncio.sleep(f.hold_s)
            await self._restart(t, f)
            return
        f.drew = 0
        await self._control(s, t, {"mode": f.kind, **f.params})
        await asyncio.sleep(f.hold_s)
        f.drew = await self._control(s, t, {"mode": "ok"})

    async def _control(self, s: aiohttp.ClientSession, t: Target, cmd: dict[str, Any]) -> int:
        async with s.post(t.url + "/chaos", json=cmd, timeout=aiohttp.ClientTimeout(10)) as r:
            return int((await r.json())["drew"])

    async def _restart(self, t: Target, f: Fault) -> None:
        deadline = time.monotonic() + RESTART_FOR_S
        while True:
            try:
                await asyncio.to_thread(self._start_replica, t)
                f.restart_error = ""
                return
            except RuntimeError as e:
                f.restart_error = str(e).splitlines()[-1][-300:] if str(e) else "RuntimeError"
                if time.monotonic() > deadline:
                    self.error = f"{t.name} did not restart in {RESTART_FOR_S:.0f} s"
                    return
                await asyncio.sleep(0.3)

    # -- report -----------------------------------------------------------------------

    def _phase(self, r: Rec) -> str:
        """``cooldown``: sent after the last fault; ``fault``: under way during one or
        within ``SETTLE_S`` after it; ``between``: the rest."""
        if self.cooldown_from and r.t0 >= self.cooldown_from:
            return "cooldown"
        if any(r.t0 <= f.end + SETTLE_S and r.t1 >= f.start for f in self.faults):
            return "fault"
        return "between"

    def _refused_with_one_up(self, r: Rec) -> bool:
        """Whether ``r`` is a 5xx (nothing relayed) although a replica of its role could
        serve all along (no fault on it but ``slow``, none of ``DOWNING`` in the
        ``SETTLE_S`` before) and fewer replicas of the role than the router may try
        could not."""
        if not r.outcome.startswith("http_5"):
            return False
        role = "decode" if self.mode == "pd" else "both"
        mine = {t.name for t in self.targets.values() if t.role == role}
        bad = {
            f.target
            for f in self.faults
            if f.kind != "slow"
            and f.start <= r.t1
            and f.end + (SETTLE_S if f.kind in DOWNING else 0.0) >= r.t0
        }
        return len(bad & mine) <= int(ROUTER["retries"]) and bool(mine - bad)

    def _rotation(self, f: Fault) -> tuple[float | None, float | None]:
        """(seconds from the fault's start to its replica out of rotation, seconds from
        the fault's end to it back in, before the next fault on it), from the sampled
        ``/v1/status``."""
        url = self.targets[f.target].url
        then = self._next_fault(f)
        until = min(f.end + 5, then)
        out_at = next(
            (t for t, seen in self.samples if f.start <= t <= until and not seen[url][0]),
            None,
        )
        if out_at is None:
            return None, None
        back = next(
            (t for t, seen in self.samples if max(out_at, f.end) <= t < then and seen[url][0]),
            None,
        )
        return round(out_at - f.start, 3), None if back is None else round(back - f.end, 3)

    def _draw_bound(self, f: Fault) -> int:
        """The most requests a replica failing fast for ``f.hold_s`` may draw: the
        ``eject_after`` failures that eject it, those in flight meanwhile (one per
        client), and one trial per ejection (each at least ``eject_s``)."""
        trials = math.ceil(f.hold_s / float(ROUTER["eject-s"]))
        return int(ROUTER["eject-after"]) + self.args.clients + trials

    def _alone(self, f: Fault) -> bool:
        """Whether every other replica of ``f``'s target's role was out of rotation at
        some point of the fault (the router then sends to ejected ones)."""
        role = self.targets[f.target].role
        others = [t.url for t in self.targets.values() if t.role == role and t.name != f.target]
        return any(
            f.start <= t <= f.end and not any(seen[u][0] for u in others)
            for t, seen in self.samples
        )

    def _sample(self, r: Rec) -> dict[str, Any]:
        """A failed request for the report, with the replicas out of rotation (the
        router's ``/v1/status`` sampled last before its answer) and the faults on then."""
        names = {t.url: t.name for t in self.targets.values()}
        seen = next((seen for t, seen in reversed(self.samples) if t <= r.t1), {})
        detail = r.detail
        for url, name in names.items():
            detail = detail.replace(url, name)
        return {
            "at_s": self.rel(r.t0),
            "took_s": round(r.t1 - r.t0, 3),
            "outcome": r.outcome,
            "replica": names.get(r.replica, r.replica),
            "detail": detail,
            "out_of_rotation": [
                f"{names[u]}" + (f" (ejected {e:.1f} s)" if e else "")
                for u, (ok, e) in seen.items()
                if not ok
            ],
            "faulted": [
                f"{f.kind} {f.target}" for f in self.faults if f.start <= r.t1 and f.end >= r.t0
            ],
        }

    def _next_fault(self, f: Fault) -> float:
        """When the next fault on ``f``'s target started (infinity: none did)."""
        return min(
            (g.start for g in self.faults if g.target == f.target and g.start > f.start),
            default=math.inf,
        )

    def _recovery(self, f: Fault) -> float | None:
        """Seconds from the fault's end to the target's first good answer (P/D prefill
        replicas: the first handoff from it) to a request sent after it, and before the
        next fault on it."""
        t = self.targets[f.target]
        mine = (
            (lambda r: r.kv_from == t.name)
            if t.role == "prefill"
            else (lambda r: r.replica == t.url)
        )
        then = self._next_fault(f)
        done = [
            r.t1 for r in self.records if r.outcome == "ok" and f.end <= r.t0 < then and mine(r)
        ]
        return round(min(done) - f.end, 3) if done else None

    def report(self) -> dict[str, Any]:
        recs = self.records
        failed: list[str] = []
        wrong = [r for r in recs if r.outcome.startswith("wrong:")]
        errors = [r for r in recs if r.outcome != "ok" and not r.outcome.startswith("wrong:")]
        by_phase: dict[str, Counter[str]] = {p: Counter() for p in ("fault", "between", "cooldown")}
        sent_by_phase: Counter[str] = Counter()
        by_fault_kind: dict[str, Counter[str]] = {}
        for r in recs:
            phase = self._phase(r)
            sent_by_phase[phase] += 1
            if r.outcome == "ok":
                continue
            by_phase[phase][r.outcome] += 1
            kinds = {f.kind for f in self.faults if r.t0 <= f.end and r.t1 >= f.start} or {"none"}
            for k in kinds:
                by_fault_kind.setdefault(k, Counter())[r.outcome] += 1
        faults = []
        ff_drew = ff_sent = 0
        not_ejected: list[str] = []
        overdrawn: list[str] = []
        recovery: dict[str, list[tuple[float | None, bool]]] = {}
        for f in self.faults:
            t = self.targets[f.target]
            out_s, back_s = self._rotation(f)
            rec_s = self._recovery(f)
            then = self._next_fault(f)
            refaulted = rec_s is None and then < math.inf
            recovery.setdefault(f.kind, []).append((rec_s, refaulted))
            sent = sum(1 for r in recs if f.start <= r.t0 <= f.end)
            row: dict[str, Any] = {
                "kind": f.kind,
                "target": f.target,
                "role": t.role,
                "at_s": self.rel(f.start),
                "for_s": round(f.hold_s, 2),
                "out_of_rotation_s": out_s,
                "back_in_rotation_s": back_s,
                "recover_s": rec_s,
                "requests_meanwhile": sent,
                "errors": dict(
                    Counter(r.outcome for r in errors if r.t0 <= f.end and r.t1 >= f.start)
                ),
            }
            if f.params:
                row["params"] = f.params
            if then - f.end < (rec_s if rec_s is not None else math.inf):
                row["next_fault_s"] = round(then - f.end, 3)  # on it again before it served
            if f.drew is not None:
                row["drew"] = f.drew
            if f.restart_error:
                row["restart_error"] = f.restart_error
            if f.kind == "fail_fast" and f.drew is not None:
                ff_drew += f.drew
                ff_sent += sent
                row["share"] = round(f.drew / sent, 3) if sent else None
                row["bound"] = self._draw_bound(f)
                row["alone"] = self._alone(f)
                if f.hold_s >= EJECT_WITHIN_S and out_s is None:
                    not_ejected.append(f"{f.target}@{self.rel(f.start)}")
                if f.drew > row["bound"] and not row["alone"]:
                    overdrawn.append(f"{f.target}@{self.rel(f.start)} drew {f.drew}")
            faults.append(row)
        share = round(ff_drew / ff_sent, 4) if ff_sent else None
        cooldown_errors = by_phase["cooldown"]
        hung = sum(1 for r in recs if r.outcome == "client_timeout")
        if wrong:
            failed.append(f"wrong_answers {len(wrong)}")
        if sum(cooldown_errors.values()):
            failed.append(f"errors after the last fault {dict(cooldown_errors)}")
        refused = [r for r in errors if self._refused_with_one_up(r)]
        if refused:
            failed.append(f"5xx answers with a replica of the role up: {len(refused)}")
        if sum(by_phase["between"].values()):
            failed.append(f"errors clear of every fault {dict(by_phase['between'])}")
        if self.cooldown_from and not sent_by_phase["cooldown"]:
            failed.append("no request after the last fault")
        if hung:
            failed.append(f"client_timeouts {hung}")
        if overdrawn:
            failed.append(f"fail_fast replicas drew more than their bound: {overdrawn}")
        if not_ejected:
            failed.append(f"fail_fast replicas never out of rotation: {not_ejected}")
        if self.stuck_out:
            failed.append(f"out of rotation at the end for no reason: {self.stuck_out}")
        if self.router_died:
            failed.append(f"the router died ({self.router_died})")
        if self.error:
            failed.append(self.error)
        lat = sorted(r.t1 - r.t0 for r in recs if r.outcome == "ok")
        samples = [
            r
            for k in sorted({r.outcome for r in errors})
            for r in [r for r in errors if r.outcome == k][:3]
        ]

        def pct(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3, 1) if lat else None

        def summary(xs: list[tuple[float | None, bool]]) -> dict[str, Any]:
            got = [x for x, _ in xs if x is not None]
            refaulted = sum(again for _, again in xs)
            return {
                "n": len(xs),
                "median_s": round(statistics.median(got), 3) if got else None,
                "max_s": max(got, default=None),
                "refaulted": refaulted,
                "unrecovered": len(xs) - len(got) - refaulted,
            }

        router_log = self.router.log if self.router is not None else []
        duration = (self.load_end - self.t0) if self.t0 else 0.0
        out: dict[str, Any] = {
            "mode": self.mode,
            "ok": not failed,
            "failed": failed,
            "seed": self.seed,
            "duration_s": round(duration, 1),
            "cooldown_s": round(self.load_end - self.cooldown_from, 1) if self.t0 else 0.0,
            "replicas": {t.name: t.role for t in self.targets.values()},
            "clients": self.args.clients,
            "router_settings": ROUTER,
            "requests": len(recs),
            "answered": len(recs) - len(errors) - len(wrong),
            "per_s": round(len(recs) / duration, 1) if duration else 0.0,
            "streamed": sum(r.stream for r in recs),
            "chat": sum(r.endpoint == CHAT for r in recs),
            "wrong_answers": len(wrong),
            "wrong_by_kind": dict(Counter(r.outcome for r in wrong)),
            "bad_answers": [
                {
                    "at_s": self.rel(r.t0),
                    "outcome": r.outcome,
                    "replica": r.replica,
                    "endpoint": r.endpoint,
                    "stream": r.stream,
                    "detail": r.detail,
                }
                for r in wrong[:10]
            ],
            "errors": dict(Counter(r.outcome for r in errors)),
            "requests_by_phase": dict(sent_by_phase),
            "errors_by_phase": {p: dict(c) for p, c in by_phase.items()},
            "errors_by_fault_kind": {k: dict(c) for k, c in sorted(by_fault_kind.items())},
            "refused_with_one_up": len(refused),
            "error_samples": [self._sample(r) for r in samples],
            "latency_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)},
            "fail_fast": {
                "drew": ff_drew,
                "requests_meanwhile": ff_sent,
                "share": share,
            },
            "recovery": {k: summary(v) for k, v in sorted(recovery.items())},
            "faults": faults,
            "router": {
                "counters": self.final_status.get("counters", {}),
                "replicas": [
                    {k: r.get(k) for k in ("url", "role", "requests", "failures", "healthy")}
                    for r in self.final_status.get("replicas", [])
                ],
                "log_findings": _common.log_findings(router_log),
            },
        }
        if self.mode == "pd":
            ok = [r for r in recs if r.outcome == "ok"]
            out["pd"] = {
                "handoff": sum(bool(r.kv_from) for r in ok),
                "recompute": sum(not r.kv_from for r in ok),
            }
        return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mode", choices=(*MODES, "both"), default="both")
    ap.add_argument("--minutes", type=float, default=2.0, help="length of each mode's run")
    ap.add_argument("--seed", type=int, default=None, help="fault and load schedule (random)")
    ap.add_argument("--replicas", type=int, default=4, help="replicas (pd: at least 4)")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop client tasks")
    _common.add_cooldown(ap, most_s=15)
    ap.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}"
    )
    args = ap.parse_args()
    if not set(args.faults.split(",")) <= set(FAULTS):
        ap.error(f"--faults: choose among {','.join(FAULTS)}")
    _common.trap_signals()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    modes = MODES if args.mode == "both" else (args.mode,)
    reports: list[dict[str, Any]] = []
    pids: list[int] = []
    rc = 0
    interrupted = False
    for i, mode in enumerate(modes):
        run = Run(args, mode, seed + i)
        try:
            run.error = _common.start_error(f"{mode}:", run.start)
            if run.error:
                rc = 2
            else:
                log(
                    f"{mode}: router {run.url} in front of "
                    f"{', '.join(t.spec for t in run.targets.values())}"
                )
                try:
                    asyncio.run(run.run())
                except RuntimeError as e:
                    run.error = f"{mode}: {e}"
                    log(run.error)
                    rc = 2
        except KeyboardInterrupt:
            interrupted = True
            run.error = "interrupted"
            log("interrupted: cleaning up")
        finally:
            _common.mute_signals()
            run.cleanup()
            _common.trap_signals()
        reports.append(run.report())
        pids += run.pids
        if rc or interrupted:
            break
    failed = [f"{r['mode']}: {x}" for r in reports for x in r["failed"]]
    print(
        json.dumps(
            {
                "ok": not failed and not rc and not interrupted,
                "failed": failed,
                "seed": seed,
                "wrong_answers": sum(r["wrong_answers"] for r in reports),
                "runs": reports,
                "pids": pids,
            }
        ),
        flush=True,
    )
    if interrupted:
        return 130
    return rc or (0 if not failed else 1)


if __name__ == "__main__":
    sys.exit(main())
