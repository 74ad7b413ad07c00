"""The router's reports to the coordinators, so that ``pegaflow status`` and the
dashboard list it without being told its URL.

Every ``[router] report_interval_s`` the router sends each ``[client] coordinator`` a
``router_report`` (the op and its fields: :mod:`pegaflow.coordinator.routers`) holding
its URL, mode and replicas with their health and load, valid for
:data:`TTL_INTERVALS` intervals; stopping, it withdraws the report.  Each call has a
deadline; a coordinator that refuses a report, or misses :data:`TTL_INTERVALS` in a row
(so that the report lapses), is logged once at WARNING and tried again at the next
interval; reporting never slows the requests the router serves.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from pegaflow.errors import (
    DeadlineExceeded,
    HandshakeRefused,
    PegaError,
    Unauthorized,
    Unavailable,
    WrongPeer,
)
from pegaflow.protocol.coordinator import Op
from pegaflow.transport.rpc_client import RpcClient

log = logging.getLogger("pegaflow.router")

#: A report holds for this many report intervals (a router gone stops showing after it).
TTL_INTERVALS = 3
#: Longest wait for a coordinator to take the withdrawal when the router stops.
WITHDRAW_TIMEOUT_S = 1.0
#: What to do when a coordinator refuses the router's token or its report.
AUTH_HINT = (
    " (give the router the coordinators' cluster token or one of their tenant tokens, "
    "--security-token-file / PEGAFLOW_SECURITY_TOKEN; a tenant's router may not replace a URL "
    "another tenant's router reports)"
)


def _transient(e: PegaError) -> bool:
    """A failure the next report may not see: no answer in time, the coordinator not
    reachable this once (a refusal or the wrong peer is not)."""
    if isinstance(e, (HandshakeRefused, WrongPeer)):
        return False
    return isinstance(e, (DeadlineExceeded, Unavailable))


def advertised_url(host: str, port: int, scheme: str = "http") -> str:
    """The router's URL as the coordinators list it: ``<scheme>://host:port``, with the
    machine's host name for a wildcard bind address."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


class Reporter:
    """Sends the router's reports to every coordinator (see the module docstring).

    ``status`` returns the router's ``/v1/status`` document."""

    def __init__(
        self,
        url: str,
        coordinators: list[str],
        status: Callable[[], dict[str, Any]],
        *,
        interval_s: float,
        timeout_s: float,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.url = url
        self.interval_s = interval_s
        self.timeout_s = max(0.1, min(timeout_s, interval_s))
        self._status = status
        self._started_at = time.time()
        self._clients = {
            addr: RpcClient([addr], token=token, timeout=self.timeout_s, tls=tls)
            for addr in coordinators
        }
        self._misses: dict[str, int] = {}
        """reports in a row that failed, per coordinator"""
        self._warned: dict[str, bool] = {}
        """whether the failing run of reports was logged at WARNING, per coordinator"""
        self._task: asyncio.Task[None] | None = None

    def report(self, ttl_ms: int) -> dict[str, Any]:
        """The ``router_report`` arguments now."""
        st = self._status()
        info = st.get("router", {})
        return {
            "url": self.url,
            "mode": str(info.get("mode", "")),
            "ttl_ms": ttl_ms,
            "started_at": self._started_at,
            "max_inflight": int(info.get("max_inflight", 0)),
            "replicas": [
                {
                    **r,
                    "queued_blocks": round(r.get("queued_blocks", 0)),
                    "last_error": str(r.get("last_error") or "")[:1000],
                }
                for r in st.get("replicas", [])
            ],
            "counters": dict(st.get("counters", {})),
        }

    async def _send(self, addr: str, args: dict[str, Any], timeout: float) -> None:
        try:
            await self._clients[addr].call(Op.ROUTER_REPORT, args, timeout=timeout)
        except PegaError as e:
            self._misses[addr] = misses = self._misses.get(addr, 0) + 1
            if self._warned.get(addr) or (_transient(e) and misses < TTL_INTERVALS):
                log.debug("report to coordinator %s failed (%s: %s)", addr, e.code, e)
                return
            fix = AUTH_HINT if isinstance(e, Unauthorized) else ""
            log.warning(
                "cannot report to coordinator %s (%s: %s, %d report(s) in a row): pegaflow "
                "status and the dashboard there do not list this router until it can%s; "
                "requests are routed as before; retrying every %.3g s",
                addr, e.code, e, misses, fix, self.interval_s,
            )  # fmt: skip
            self._warned[addr] = True
            return
        if addr not in self._misses or self._warned.get(addr):
            log.info("router %s reported to coordinator %s", self.url, addr)
        self._misses[addr] = 0
        self._warned[addr] = False

    async def send_all(self, ttl_ms: int, timeout: float) -> None:
        """One report to every coordinator at once, each within ``timeout`` seconds."""
        args = self.report(ttl_ms)
        await asyncio.gather(*(self._send(a, args, timeout) for a in self._clients))

    async def _loop(self) -> None:
        ttl_ms = max(1, round(TTL_INTERVALS * self.interval_s * 1000))
        while True:
            try:
                await self.send_all(ttl_ms, self.timeout_s)
            except Exception:  # never let the loop die
                log.exception("router report round failed")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        """Report now and every interval, in the background."""
        if self._task is None and self._clients:
            self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        """Stop reporting and withdraw the report (within :data:`WITHDRAW_TIMEOUT_S`)."""
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        args = self.report(0)
        timeout = min(WITHDRAW_TIMEOUT_S, self.timeout_s)
        calls = (c.call(Op.ROUTER_REPORT, args, timeout=timeout) for c in self._clients.values())
        results = await asyncio.gather(*calls, return_exceptions=True)
        for addr, res in zip(self._clients, results, strict=True):
            if isinstance(res, Exception):
                log.debug("withdrawing from coordinator %s failed: %s", addr, res)
        for c in self._clients.values():
            await c.close()
