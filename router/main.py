"""``pegaflow-router``: an OpenAI-compatible proxy in front of vLLM replicas.

Serves ``/v1/completions``, ``/v1/chat/completions`` (streams relayed as they come),
``/v1/models``, ``/health``, ``/v1/status`` and ``/metrics`` on ``[router] host:port``.
Prints ``READY <host:port> mode=<mode>`` once serving.  Modes, replicas and flags:
docs/router.md.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from pegaflow.config import ClusterConfig
from pegaflow.errors import BadRequest
from pegaflow.observability import telemetry
from pegaflow.service import run_service, taken_ports

from .server import Router

log = logging.getLogger("pegaflow.router")


async def run(cfg: ClusterConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    try:
        router = Router(cfg.router, cfg.client, cfg.security)
    except BadRequest as e:
        raise ValueError(str(e)) from None
    telemetry.setup(cfg.telemetry, service="pegaflow-router", registry=router.metrics.registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    r = cfg.router
    try:
        await router.start()
    except OSError as e:
        hint = taken_ports([(r.host, r.port, "--router-port")])
        why = f"cannot listen on {r.host}:{r.port}: {e}" + (f" ({hint})" if hint else "")
        raise OSError(why) from None
    healthy = sum(x.healthy for x in router.replicas)
    log.info(
        "router serving on %s:%d, mode %s, %d of %d replicas healthy",
        r.host, router.port, r.mode, healthy, len(router.replicas),
    )  # fmt: skip
    if not healthy:
        log.warning("no replica answers /health yet: requests get 503 until one does")
    print(f"READY {r.host}:{router.port} mode={r.mode}", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("stopping the router")
        await router.close()
        telemetry.shutdown()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pegaflow-router``."""
    sections = ["router", "client", "security", "telemetry"]
    run_service("pegaflow-router", __doc__, sections, run, argv)


if __name__ == "__main__":
    main()
