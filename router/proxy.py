"""The router's proxying: one request sent to a replica and its answer relayed to the
client, retried on another replica while nothing was relayed, and the prefill step of
``pd`` mode.

Every upstream call has a deadline (:class:`~pegaflow.config.RouterConfig`), a stream's
first bytes ``first_byte_timeout_s`` (a long prefill), and a client that goes away
cancels its request (the upstream request is closed, vLLM aborts it).  A request whose
replica fails before the first byte of the answer reached the client is retried on
another replica (nothing was relayed, so it is safe); a failure after that is made
visible, never a clean end: a stream ends with an error event, any other answer is cut
off (its connection aborted).  Answers are relayed chunk by chunk as they come, never
read whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable
from typing import Any

import aiohttp
from aiohttp import web

from pegaflow.config import RouterConfig

from .backends import NET_ERRORS, Backends, UpstreamFailed, describe
from .policy import Choice, Replica

log = logging.getLogger("pegaflow.router")

REPLICA_HEADER = "X-PegaFlow-Replica"
"""response header naming the replica that answered"""
_FORWARD_HEADERS = ("Authorization", "X-Request-Id")
ERROR_BODY_BYTES = 64 << 10
"""most of a replica's 5xx answer kept (to answer with when no other replica is left)"""
_DONE = b"data: [DONE]"


def error_body(message: str, status: int, kind: str = "RouterError") -> dict[str, Any]:
    """An error in the OpenAI format vLLM answers with."""
    return {"error": {"message": message, "type": kind, "code": status}}


def error(message: str, status: int, kind: str = "RouterError") -> web.Response:
    """An error answer (:func:`error_body`) of HTTP ``status``."""
    return web.json_response(error_body(message, status, kind), status=status)


def _sse_error(message: str) -> bytes:
    """The end of a stream that broke: an error event, then ``[DONE]`` (what vLLM sends
    when a request fails mid-stream)."""
    ev = json.dumps(error_body(message, 502, "UpstreamError"))
    return f"data: {ev}\n\ndata: [DONE]\n\n".encode()


class Proxy:
    """Sends requests to the replicas of ``backends`` and relays their answers."""

    def __init__(self, cfg: RouterConfig, backends: Backends) -> None:
        self.cfg = cfg
        self.backends = backends
        self.picker = backends.picker
        self.metrics = backends.metrics

    def _timeout(self, total: float | None = None, stream: bool = False) -> aiohttp.ClientTimeout:
        """Deadlines of one upstream request; the wait between two reads is bounded for
        streams only (a plain answer sends nothing until it is complete)."""
        return aiohttp.ClientTimeout(
            total=total if total is not None else self.cfg.request_timeout_s,
            connect=self.cfg.connect_timeout_s,
            sock_read=self.cfg.read_timeout_s if stream else None,
        )

    @staticmethod
    def _headers(req: web.Request) -> dict[str, str]:
        h = {k: req.headers[k] for k in _FORWARD_HEADERS if k in req.headers}
        h["Content-Type"] = "application/json"
        return h

    def _no_replica_message(self, role: str, tried: Iterable[str]) -> str:
        tried = list(tried)
        what = "no healthy replica" + ("" if role == "both" else f" with role {role}")
        if tried:
            what = f"every replica tried failed ({', '.join(tried)}) and {what} is left"
        return f"{what}; see the router's /v1/status for each replica's last error"

    async def _forward(
        self,
        req: web.Request,
        endpoint: str,
        payload: bytes | bytearray,
        stream: bool,
        first: Choice,
        role: str,
        t0: float,
    ) -> web.StreamResponse:
        """Send to ``first``'s replica, then (a failure before any byte reached the
        client) to the least loaded others, ``retries`` times at most.  When none is
        left: the last replica's own 5xx answer, else a 503."""
        tried: list[str] = []
        rep = first.replica
        answer: web.Response | None = None
        for attempt in range(1 + max(0, self.cfg.retries)):
            if attempt:
                rep = self.picker.least_loaded(role, tried)
                if rep is not None:
                    self.metrics.retries.inc()
            if rep is None:
                break
            tried.append(rep.url)
            try:
                return await self._send(req, rep, endpoint, payload, stream, t0, first.work)
            except UpstreamFailed as e:
                answer = e.answer
                log.warning("request to %s failed before any answer: %s; retrying", rep.url, e)
        return answer or error(self._no_replica_message(role, tried), 503)

    async def _send(
        self,
        req: web.Request,
        rep: Replica,
        endpoint: str,
        payload: bytes | bytearray,
        stream: bool,
        t0: float,
        work: float = 0.0,
    ) -> web.StreamResponse:
        """One upstream request, ``work`` blocks of prefill (queued on ``rep`` until the
        first bytes); ``UpstreamFailed`` while nothing was sent downstream."""
        with self.backends.busy(rep):
            up: aiohttp.ClientResponse | None = None
            sent = time.monotonic()
            try:
                first = self._first_bytes(rep, endpoint, payload, self._headers(req), stream, sent)
                with self.backends.prefilling(rep, work):
                    up, chunk = await self.backends.guard(rep, sent, first)
                return await self._relay(req, rep, up, chunk, stream, endpoint, t0, sent)
            except asyncio.CancelledError:  # the client went away: closing ``up`` aborts it
                self.metrics.upstream.labels(rep.url, "client_left").inc()
                raise
            finally:
                if up is not None:
                    up.close()

    async def _first_bytes(
        self,
        rep: Replica,
        endpoint: str,
        payload: bytes | bytearray,
        headers: dict[str, str],
        stream: bool,
        sent: float,
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """Send the request and wait for the answer's first bytes; ``UpstreamFailed``
        when the replica cannot be reached, times out or answers a 5xx."""
        deadline = self.cfg.first_byte_timeout_s if stream else None
        try:
            async with asyncio.timeout(deadline):
                up = await self.backends.session.post(
                    rep.url + endpoint,
                    data=payload,
                    headers=headers,
                    timeout=self._timeout(stream=stream),
                )
                try:
                    chunk = await up.content.readany()
                except BaseException:
                    up.close()
                    raise
        except TimeoutError:
            why = "timed out" if deadline is None else (
                f"no first byte within {deadline} s (--router-first-byte-timeout-s)"
            )  # fmt: skip
            self.backends.failed(rep, why, "first_byte_timeout", sent=sent)
            raise UpstreamFailed(why) from None
        except NET_ERRORS as e:
            self.backends.failed(rep, e, "connect_error", sent=sent)
            raise UpstreamFailed(describe(e)) from None
        if up.status >= 500:
            try:
                async with asyncio.timeout(self.cfg.connect_timeout_s):
                    while chunk and len(chunk) < ERROR_BODY_BYTES:
                        more = await up.content.readany()
                        if not more:
                            break
                        chunk += more
            except NET_ERRORS:
                pass
            up.close()
            why = f"answered {up.status}"
            self.backends.failed(rep, why, str(up.status), down=False, sent=sent)
            ctype = up.headers.get("Content-Type", "application/json")
            answer = web.Response(
                body=chunk[:ERROR_BODY_BYTES],
                status=up.status,
                headers={"Content-Type": ctype, REPLICA_HEADER: rep.url},
            )
            raise UpstreamFailed(why, answer)
        if stream and up.status == 200 and not chunk:
            up.close()
            why = "closed the stream before its first event"
            self.backends.failed(rep, why, "read_error", sent=sent)
            raise UpstreamFailed("empty stream")
        return up, chunk

    async def _relay(
        self,
        req: web.Request,
        rep: Replica,
        up: aiohttp.ClientResponse,
        chunk: bytes,
        stream: bool,
        endpoint: str,
        t0: float,
        sent: float,
    ) -> web.StreamResponse:
        """Relay the answer chunk by chunk (never read whole).  A failure once bytes
        went out is made visible: a stream ends with an error event, as does one that
        ends without ``data: [DONE]``; any other answer is cut off (its connection
        aborted: the client sees a short body, never a complete-looking one)."""
        self.metrics.first_byte.labels(endpoint).observe(time.monotonic() - t0)
        sse = stream and up.status == 200
        headers = {"Content-Type": up.headers.get("Content-Type", "application/json")}
        headers[REPLICA_HEADER] = rep.url
        if "Content-Encoding" in up.headers:
            headers["Content-Encoding"] = up.headers["Content-Encoding"]
        if sse:
            headers["Cache-Control"] = "no-cache"
        out = web.StreamResponse(status=up.status, headers=headers)
        if not sse and up.content_length is not None:
            out.content_length = up.content_length
        failure: BaseException | str | None = None
        outcome = "stream_broken"
        tail = b""
        try:
            await out.prepare(req)
            while chunk:
                await out.write(chunk)
                tail = (tail + chunk)[-64:]
                try:
                    chunk = await up.content.readany()
                except NET_ERRORS as e:
                    failure = e
                    break
            if failure is None and sse and not tail.rstrip().endswith(_DONE):
                failure, outcome = "ended the stream without data: [DONE]", "truncated"
            if failure is None:
                self.backends.answered(rep, up.status, sent)
                await out.write_eof()
                return out
            why = failure if isinstance(failure, str) else describe(failure)
            log.warning("replica %s broke a stream mid-way: %s", rep.url, why)
            down = not isinstance(failure, str)  # a broken connection, not a short stream
            self.backends.failed(rep, failure, outcome, down=down, sent=sent)
            if sse:
                await out.write(_sse_error(f"replica {rep.url} failed mid-stream: {why}"))
                await out.write_eof()
            elif req.transport is not None:
                req.transport.abort()
        except ConnectionError:  # the client left; closing ``up`` aborts the request upstream
            if failure is None:
                self.metrics.upstream.labels(rep.url, "client_left").inc()
        return out

    # ---- prefill/decode ------------------------------------------------------------

    @staticmethod
    def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
        """The prefill replica's request: the same prompt, one token, no stream."""
        pre = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        pre.update(stream=False, max_tokens=1, n=1)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        return pre

    async def _prefill(
        self, req: web.Request, endpoint: str, body: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, web.Response | None]:
        """``(kv_transfer_params or None, None)``, or ``(None, an error to answer)``
        when the prefill replica rejected the request itself (a 4xx)."""
        payload = json.dumps(self.prefill_body(body)).encode()
        tried: list[str] = []
        for _ in range(1 + max(0, self.cfg.retries)):
            rep = self.picker.least_loaded("prefill", tried)
            if rep is None:
                break
            tried.append(rep.url)
            with self.backends.busy(rep):
                sent = time.monotonic()
                try:
                    return await self._prefill_on(req, rep, endpoint, payload, sent)
                except NET_ERRORS as e:
                    self.backends.failed(rep, e, "prefill_error", sent=sent)
                    log.warning("prefill on %s failed: %s", rep.url, describe(e))
        return None, None

    async def _prefill_on(
        self, req: web.Request, rep: Replica, endpoint: str, payload: bytes, sent: float
    ) -> tuple[dict[str, Any] | None, web.Response | None]:
        """The prefill on ``rep`` (sent at ``sent``), as :meth:`_prefill` answers."""
        async with self.backends.session.post(
            rep.url + endpoint,
            data=payload,
            headers=self._headers(req),
            timeout=self._timeout(self.cfg.prefill_timeout_s),
        ) as r:
            data = await r.read()
            if r.status >= 500:
                why = f"prefill answered {r.status}"
                self.backends.failed(rep, why, str(r.status), down=False, sent=sent)
            else:
                self.backends.answered(rep, r.status, sent)
            if 400 <= r.status < 500:
                ctype = r.headers.get("Content-Type", "application/json")
                return None, web.Response(
                    body=data, status=r.status, headers={"Content-Type": ctype}
                )
            if r.status != 200:
                log.warning("prefill on %s answered %d: decode recomputes", rep.url, r.status)
                return None, None
            try:
                params = json.loads(data).get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
            return (params if isinstance(params, dict) and params else None), None
