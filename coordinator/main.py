"""``pegaflow-coordinator``: the global index service of a PegaFlow cluster.

Mirrors the index from etcd and answers lookups, placements and status over the control
protocol, plus HTTP ``/health``, ``/metrics`` and ``/v1/status``.  Run one or more; each
is a full read replica.  Prints ``READY <host:port> http=<port>`` once serving.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

from pegaflow.config import ClusterConfig
from pegaflow.observability import telemetry
from pegaflow.service import run_service, taken_ports

from .service import Coordinator

log = logging.getLogger("pegaflow.coordinator")


async def run(cfg: ClusterConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    if not cfg.etcd.endpoints:
        log.warning(
            "no [etcd] endpoints: this coordinator serves an empty index that nothing feeds; "
            "pass --etcd-endpoints host:port (or run pegaflow-server for a single host)"
        )
    coordinator = Coordinator(cfg.coordinator, etcd=cfg.etcd, security=cfg.security)
    telemetry.setup(cfg.telemetry, service="pegaflow-coordinator", registry=coordinator.registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await coordinator.start()
    except OSError as e:
        await coordinator.close()
        c = cfg.coordinator
        hint = taken_ports([
            (c.host, c.port, "--coordinator-port"),
            (c.http_host, c.http_port, "--coordinator-http-port"),
        ])  # fmt: skip
        log.error(
            "cannot listen on %s:%d or http %s:%d: %s",
            c.host, c.port, c.http_host, c.http_port, f"{e} ({hint})" if hint else e,
        )  # fmt: skip
        raise SystemExit(2) from None
    # Everything loaded so far lives as long as the process: keep it out of the
    # collector's full passes, which would otherwise stall lookups for milliseconds.
    gc.collect()
    gc.freeze()
    http = coordinator.http_port if coordinator.http_port is not None else -1
    log.info(
        "coordinator %s serving on %s (http %s), cluster prefix %s",
        coordinator.id,
        coordinator.address,
        http,
        cfg.etcd.prefix,
    )
    print(f"READY {coordinator.address} http={http}", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("stopping coordinator %s", coordinator.id)
        await coordinator.close()
        telemetry.shutdown()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pegaflow-coordinator``."""
    run_service(
        "pegaflow-coordinator", __doc__, ["etcd", "security", "coordinator", "telemetry"], run, argv
    )


if __name__ == "__main__":
    main()
