#!/usr/bin/env python3
"""The stand-in replica of the router chaos suite (``scripts/chaos_router.py``): an
OpenAI-style server whose failures the orchestrator sets, and the answer every replica
gives for a request (so that the orchestrator checks every answer).

    python -m scripts.chaos_replica --name r1 --port 8001   # started by chaos_router.py
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import signal
from typing import Any

from aiohttp import web

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
TOKEN_S = 0.01
"""a healthy replica's pace: one token every 10 ms"""


# ---- answers: what every replica gives for a request ---------------------------------


def prompt_digest(endpoint: str, body: dict[str, Any]) -> str:
    """The request's prompt (or messages), hashed: what a prefill hands to a decode."""
    what = body.get("messages") if endpoint == CHAT else body.get("prompt")
    raw = json.dumps([endpoint, what], sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()


def answer_pieces(endpoint: str, body: dict[str, Any]) -> list[str]:
    """The tokens of the answer to ``body``: its prompt's digest spelt out, as many as
    it asks (``max_tokens``)."""
    n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
    seed = bytes.fromhex(prompt_digest(endpoint, body)) + n.to_bytes(4, "big")
    stream = b"".join(
        hashlib.sha256(seed + i.to_bytes(4, "big")).digest() for i in range((n + 31) // 32)
    )
    return [f" t{b:02x}" for b in stream[:n]]


def answer_json(endpoint: str, text: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A whole answer in the OpenAI format."""
    if endpoint == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    else:
        choice, obj = {"index": 0, "text": text}, "text_completion"
    return {
        "object": obj,
        "model": "chaos",
        "choices": [{**choice, "finish_reason": "length"}],
        **extra,
    }


def event(endpoint: str, piece: str, extra: dict[str, Any]) -> bytes:
    """One server-sent event of a streamed answer."""
    if endpoint == CHAT:
        chunk = {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": piece}}],
        }
    else:
        chunk = {"object": "text_completion", "choices": [{"index": 0, "text": piece}]}
    return f"data: {json.dumps({**chunk, 'model': 'chaos', **extra})}\n\n".encode()


def piece_of(ev: dict[str, Any]) -> str:
    """The text an event (or a whole answer) carries."""
    choice = (ev.get("choices") or [{}])[0]
    if "text" in choice:
        return str(choice["text"])
    part = choice.get("delta") or choice.get("message") or {}
    return str(part.get("content") or "")


# ---- the stand-in replica (its own process) ------------------------------------------


class FakeReplica:
    """An OpenAI-style server whose failures the orchestrator sets (``POST /chaos``)."""

    def __init__(self, name: str, port: int) -> None:
        self.name = name
        self.port = port
        self.mode = "ok"
        self.params: dict[str, Any] = {}
        self.drew = 0
        """requests that arrived in the current mode"""
        self.served = 0
        self.running = asyncio.Event()
        self.running.set()
        self.rng = random.Random()

    async def serve(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post(COMPLETIONS, self.completion)
        app.router.add_post(CHAT, self.completion)
        app.router.add_post("/chaos", self.control)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port, reuse_address=True).start()
        return runner

    async def control(self, req: web.Request) -> web.Response:
        """Set the mode (``ok`` or a fault and its parameters); answers the requests
        that arrived in the mode it ends."""
        cmd = await req.json()
        drew, self.drew = self.drew, 0
        self.mode, self.params = cmd.get("mode", "ok"), cmd
        if self.mode == "hang":
            self.running.clear()
        else:
            self.running.set()
        return web.json_response({"drew": drew, "served": self.served})

    async def health(self, _req: web.Request) -> web.Response:
        if self.mode == "hang" and self.params.get("health") == "hung":
            await self.running.wait()
        return web.json_response({"ok": True})

    async def models(self, _req: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "chaos"}]})

    async def completion(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        self.drew += 1
        self.served += 1
        mode, params = self.mode, self.params
        if mode == "fail_fast":
            err = {"error": {"message": "engine dead", "type": "InternalServerError"}}
            return web.json_response(err, status=500)
        endpoint = req.path
        extra: dict[str, Any] = {"chaos": {"replica": self.name}}
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict):
            extra["chaos"]["kv_from"] = kv.get("from", "")
        if kv is not None and (
            not isinstance(kv, dict) or kv.get("digest") != prompt_digest(endpoint, body)
        ):
            pieces = [" MISMATCHED_KV"]  # another prompt's handoff: a wrong answer
        else:
            pieces = answer_pieces(endpoint, body)
        pace = TOKEN_S
        if mode == "slow":
            pace = float(params["pace_s"])
            await asyncio.sleep(float(params["first_s"]))
        cut = self.rng.randrange(len(pieces)) if mode == "truncate" else -1
        cleanly = self.rng.random() < 0.5
        await self.running.wait()  # hang: before the first byte
        try:
            if not body.get("stream"):
                return await self._plain(req, endpoint, body, pieces, pace, cut >= 0, extra)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(req)
            for i, piece in enumerate(pieces):
                if i == cut:
                    if cleanly:
                        await out.write_eof()  # the end, without [DONE]
                    elif req.transport is not None:
                        req.transport.abort()
                    return out
                await out.write(event(endpoint, piece, extra))
                await asyncio.sleep(pace)
                await self.running.wait()  # hang: mid-stream
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        except (ConnectionError, RuntimeError):  # the router closed the request
            return web.Response(status=499)

    async def _plain(
        self,
        req: web.Request,
        endpoint: str,
        body: dict[str, Any],
        pieces: list[str],
        pace: float,
        cut: bool,
        extra: dict[str, Any],
    ) -> web.StreamResponse:
        """A whole answer, in two writes (a hang or a cut falls between them)."""
        await asyncio.sleep(pace * len(pieces))
        await self.running.wait()
        answer = answer_json(endpoint, "".join(pieces), extra)
        if body.get("max_tokens") == 1 and "kv_transfer_params" not in body:  # a prefill
            answer["kv_transfer_params"] = {
                "digest": prompt_digest(endpoint, body),
                "from": self.name,
            }
        data = json.dumps(answer).encode()
        out = web.StreamResponse(headers={"Content-Type": "application/json"})
        out.content_length = len(data)
        await out.prepare(req)
        await out.write(data[: len(data) // 2])
        if cut:
            if req.transport is not None:
                req.transport.abort()
            return out
        await self.running.wait()
        await out.write(data[len(data) // 2 :])
        await out.write_eof()
        return out


async def replica_main(name: str, port: int) -> None:
    """Entry point of a replica process: serve until SIGTERM."""
    rep = FakeReplica(name, port)
    runner = await rep.serve()
    print(f"READY 127.0.0.1:{port} name={name}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    rep.running.set()
    await runner.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True, help="the replica's name (in every answer)")
    ap.add_argument("--port", type=int, required=True, help="its port on 127.0.0.1")
    args = ap.parse_args()
    asyncio.run(replica_main(args.name, args.port))


if __name__ == "__main__":
    main()
