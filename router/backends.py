"""The router's replicas as a pool: their health checks, ejection after failed answers,
and the bookkeeping of each request sent to one.

A replica that cannot be reached is taken out of rotation at once; the periodic health
check puts it back.  A replica that answers its ``/health`` but fails its answers (5xx,
broken or truncated streams) is ejected after ``eject_after`` of them in a row
(:mod:`pegaflow.router.policy`), and a failed ``/health`` cancels the requests still
waiting for its first byte (:meth:`Backends.guard`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from pegaflow.config import RouterConfig

from .kvevents import GpuView
from .metrics import RouterMetrics
from .policy import Picker, Replica

log = logging.getLogger("pegaflow.router")

T = TypeVar("T")

#: What a failed upstream call raises (connection refused/reset, deadline, bad answer).
NET_ERRORS = (TimeoutError, aiohttp.ClientError, OSError)


def describe(e: BaseException) -> str:
    """``e`` in a few words, for logs and a replica's last error."""
    if isinstance(e, TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class UpstreamFailed(Exception):
    """A replica failed before any byte of its answer reached the client (retryable);
    ``answer``: its own error answer (a 5xx), given when no other replica is left."""

    def __init__(self, why: str, answer: web.Response | None = None) -> None:
        super().__init__(why)
        self.answer = answer


class Backends:
    """The replicas, the picker over them, their health and the HTTP session to them."""

    def __init__(self, cfg: RouterConfig, replicas: list[Replica], metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.replicas = replicas
        self.picker = Picker(
            replicas, cfg.max_inflight, queue_weight=cfg.queue_weight, load_blocks=cfg.load_blocks
        )
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._opening: dict[str, set[asyncio.Future[Any]]] = {r.url: set() for r in replicas}
        self.views: dict[str, GpuView] = {}
        """each replica's GPU cache from its KV events, by URL (cache mode, ``events=``):
        cleared when its ``/health`` fails (it may be restarting), touched by requests"""
        for r in replicas:
            metrics.healthy.labels(r.url, r.role).set(0)
            metrics.inflight.labels(r.url).set(0)

    @property
    def session(self) -> aiohttp.ClientSession:
        """The client session to the replicas (once started)."""
        assert self._session is not None, "the router is not started"
        return self._session

    async def start(self, connections: int) -> None:
        """Open the session (``connections`` at once, besides the probes), check every
        replica once, then keep checking every ``health_interval_s``."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=connections + len(self.replicas) + 8, force_close=False
            ),
            auto_decompress=False,
        )
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        """Stop the health checks and close the session."""
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    # ---- health --------------------------------------------------------------------

    def _set_health(self, rep: Replica, ok: bool, why: str = "") -> None:
        if ok and not rep.healthy:
            log.info("replica %s (%s) is healthy: in rotation", rep.url, rep.role)
        elif not ok and rep.healthy:
            log.warning(
                "replica %s (%s) out of rotation: %s; requests go to the others until its "
                "/health answers again",
                rep.url,
                rep.role,
                why,
            )
        if not ok:
            rep.last_error = why
            view = self.views.get(rep.url)
            if view is not None and rep.healthy:
                view.clear()
        rep.healthy = ok
        ejected = time.monotonic() < rep.ejected_until
        self.metrics.healthy.labels(rep.url, rep.role).set(1 if ok and not ejected else 0)

    async def _probe(self, rep: Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=self.cfg.health_timeout_s)
        try:
            async with self.session.get(rep.url + "/health", timeout=timeout) as r:
                await r.read()
                ok, why = r.status == 200, f"/health answered {r.status}"
        except NET_ERRORS as e:
            ok, why = False, f"/health: {describe(e)}"
        self._set_health(rep, ok, why)
        if not ok:  # requests waiting for its first byte: retried elsewhere
            for task in list(self._opening.get(rep.url, ())):
                task.cancel()

    async def check_health(self) -> None:
        """Ask every replica's ``/health`` once (within ``health_timeout_s``)."""
        await asyncio.gather(*(self._probe(r) for r in self.replicas))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # never let the loop die
                log.exception("health check round failed")

    # ---- answers -------------------------------------------------------------------

    def failed(
        self,
        rep: Replica,
        e: BaseException | str,
        outcome: str,
        down: bool = True,
        sent: float | None = None,
    ) -> None:
        """A failed answer to a request sent at ``sent`` (monotonic; None: now): counted
        against the replica (``eject_after`` in a row eject it); ``down`` (it could not
        be reached, or timed out): out of rotation at once, until its ``/health``
        answers."""
        why = e if isinstance(e, str) else describe(e)
        rep.failures += 1
        rep.last_error = why
        self.metrics.upstream.labels(rep.url, outcome).inc()
        seconds = rep.note_failure(time.monotonic(), self.cfg.eject_after, self.cfg.eject_s, sent)
        if seconds:
            log.warning(
                "replica %s (%s) out of rotation for %.0f s: %d failed answers in a row "
                "(last: %s) though its /health may answer; then one trial request",
                rep.url, rep.role, seconds, rep.failed_in_row, why,
            )  # fmt: skip
            self.metrics.healthy.labels(rep.url, rep.role).set(0)
        if down:
            self._set_health(rep, False, why)

    def answered(self, rep: Replica, status: int, sent: float) -> None:
        """An answer that did not fail (a 4xx is the request's fault, not the replica's)
        to a request sent at ``sent``."""
        self.metrics.upstream.labels(rep.url, str(status)).inc()
        if rep.note_success(sent):
            log.info("replica %s (%s) answered its trial request: in rotation", rep.url, rep.role)
            self.metrics.healthy.labels(rep.url, rep.role).set(1 if rep.healthy else 0)

    @contextmanager
    def busy(self, rep: Replica) -> Iterator[None]:
        """Count a request in flight on ``rep`` for the body of the ``with``."""
        rep.inflight += 1
        rep.requests += 1
        self.metrics.inflight.labels(rep.url).inc()
        view = self.views.get(rep.url)
        if view is not None:
            view.touch(time.monotonic())
        try:
            yield
        finally:
            rep.inflight -= 1
            self.metrics.inflight.labels(rep.url).dec()
            if view is not None:
                view.touch(time.monotonic())

    @contextmanager
    def prefilling(self, rep: Replica, blocks: float) -> Iterator[None]:
        """Count ``blocks`` of prefill queued on ``rep`` for the body of the ``with``
        (a request until its answer's first bytes, :meth:`Picker.cost`)."""
        rep.queued_blocks += blocks
        try:
            yield
        finally:
            rep.queued_blocks = max(0.0, rep.queued_blocks - blocks)

    async def guard(self, rep: Replica, sent: float, first: Awaitable[T]) -> T:
        """Await ``first`` (a request sent at ``sent``, until its answer's first bytes)
        in a task that a failed ``/health`` of ``rep`` cancels: ``UpstreamFailed`` then."""
        task = asyncio.ensure_future(first)
        waiting = self._opening.setdefault(rep.url, set())
        waiting.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if this is not None and this.cancelling():
                raise  # the client went away (``task`` is cancelled with us)
            why = f"failed its /health while the request waited ({rep.last_error})"
            self.failed(rep, why, "health_failed", down=False, sent=sent)
            raise UpstreamFailed(why) from None
        finally:
            waiting.discard(task)
