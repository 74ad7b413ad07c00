"""``pegaflow-coordinator``: the global index service of a PegaFlow cluster.

Mirrors the index from etcd and answers lookups, placements and status over the control
protocol, plus HTTP ``/health``, ``/metrics`` and ``/v1/status``.  Run one or more; each
is a full read replica.  Prints ``READY <host:port> http=<port>`` once serving.
"""

from __future__ import annotations

import gc

from pegaflow import huge_pages
from pegaflow.config import ClusterConfig
from pegaflow.runner import Runner, run_service

from .service import Coordinator


async def start(cfg: ClusterConfig, run: Runner) -> str:
    """Start the coordinator; its READY line."""
    if not cfg.etcd.endpoints:
        run.log.warning(
            "no [etcd] endpoints: this coordinator serves an empty index that nothing feeds; "
            "pass --etcd-endpoints host:port (or run pegaflow-server for a single host)"
        )
    coordinator = Coordinator(cfg.coordinator, etcd=cfg.etcd, security=cfg.security)
    run.telemetry(coordinator.registry)
    c = cfg.coordinator
    try:
        await run.enter(coordinator.start(), lambda failed: coordinator.close())
    except OSError as e:
        run.fail_on_ports(
            f"cannot listen on {c.host}:{c.port} or http {c.http_host}:{c.http_port}", e, [
                (c.host, c.port, "--coordinator-port"),
                (c.http_host, c.http_port, "--coordinator-http-port"),
            ],
        )  # fmt: skip
    # Everything loaded so far lives as long as the process: keep it out of the
    # collector's full passes, which would otherwise stall lookups for milliseconds.
    gc.collect()
    gc.freeze()
    http = coordinator.http_port if coordinator.http_port is not None else -1
    run.log.info(
        "coordinator %s serving on %s (http %s), cluster prefix %s",
        coordinator.id,
        coordinator.address,
        http,
        cfg.etcd.prefix,
    )
    run.stopping = f"stopping coordinator {coordinator.id}"
    return f"READY {coordinator.address} http={http}"


def prepare(cfg: ClusterConfig) -> None:
    """Before anything is loaded: re-execute with huge pages (``[coordinator] huge_pages``)."""
    if cfg.coordinator.huge_pages:
        huge_pages.reexec_with_huge_pages()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pegaflow-coordinator``."""
    sections = ["etcd", "security", "coordinator", "telemetry"]
    run_service("pegaflow-coordinator", __doc__, sections, start, argv, prepare=prepare)


if __name__ == "__main__":
    main()
