"""``pegaflow-coordinator``: the global index service of a PegaFlow cluster.

Mirrors the index from etcd and answers lookups, placements and status over the control
protocol, plus HTTP ``/health``, ``/metrics`` and ``/v1/status``.  Run one or more; each
is a full read replica.  Prints ``READY <host:port> http=<port>`` once serving.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

import uvloop

from pegaflow import telemetry
from pegaflow.config import ClusterConfig, add_arguments, config_from_args

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
        log.error(
            "cannot listen on %s:%d or http %s:%d: %s (pick free ports with "
            "--coordinator-port / --coordinator-http-port)",
            cfg.coordinator.host,
            cfg.coordinator.port,
            cfg.coordinator.http_host,
            cfg.coordinator.http_port,
            e,
        )
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
    parser = argparse.ArgumentParser(prog="pegaflow-coordinator", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    add_arguments(parser, ["etcd", "security", "coordinator", "telemetry"])
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = config_from_args(args)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    uvloop.run(run(cfg))


if __name__ == "__main__":
    main()
