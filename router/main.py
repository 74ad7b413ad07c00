"""``pegaflow-router``: an OpenAI-compatible proxy in front of vLLM replicas.

Serves ``/v1/completions``, ``/v1/chat/completions`` (streams relayed as they come),
``/v1/models``, ``/health``, ``/v1/status`` and ``/metrics`` on ``[router] host:port``.
Prints ``READY <host:port> mode=<mode>`` once serving.  Modes, replicas and flags:
docs/router.md.
"""

from __future__ import annotations

from pegaflow.config import ClusterConfig
from pegaflow.errors import BadRequest
from pegaflow.runner import Runner, run_service, taken_ports

from .server import Router


async def start(cfg: ClusterConfig, run: Runner) -> str:
    """Start the router; its READY line."""
    try:
        router = Router(cfg.router, cfg.client, cfg.security)
    except BadRequest as e:
        raise ValueError(str(e)) from None
    run.telemetry(router.metrics.registry)
    r = cfg.router
    try:
        await run.enter(router.start(), lambda failed: router.close())
    except OSError as e:
        hint = taken_ports([(r.host, r.port, "--router-port")])
        why = f"cannot listen on {r.host}:{r.port}: {e}" + (f" ({hint})" if hint else "")
        raise OSError(why) from None
    healthy = sum(x.healthy for x in router.replicas)
    run.log.info(
        "router serving on %s:%d, mode %s, %d of %d replicas healthy",
        r.host, router.port, r.mode, healthy, len(router.replicas),
    )  # fmt: skip
    if not healthy:
        run.log.warning("no replica answers /health yet: requests get 503 until one does")
    run.stopping = "stopping the router"
    return f"READY {r.host}:{router.port} mode={r.mode}"


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pegaflow-router``."""
    run_service(
        "pegaflow-router", __doc__, ["router", "client", "security", "telemetry"], start, argv
    )


if __name__ == "__main__":
    main()
