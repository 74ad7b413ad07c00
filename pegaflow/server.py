"""``pegaflow-server``: the single-host, all-in-one default.

One process runs a coordinator and a storage node, speaking the same protocols as a
cluster: clients and vLLM connectors point at it exactly as at a coordinator.  Without
``--etcd-endpoints`` the node feeds the coordinator's index in-process (no etcd, the
index lives as long as the process); with them, both use etcd like a cluster.

One HTTP endpoint (the coordinator's) serves ``/health``, ``/metrics`` (coordinator and
node metrics) and ``/v1/status``.  Prints
``READY coordinator=<host:port> node=<id> ucx=<host:port> http=<port>`` once serving.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from pegaflow import telemetry
from pegaflow.config import ClusterConfig
from pegaflow.coordinator.index import BlockIndex, LocalSink
from pegaflow.coordinator.service import Coordinator
from pegaflow.http import new_registry
from pegaflow.inventory import InventorySink
from pegaflow.service import run_service
from pegaflow.storage_node.node import StorageNode

log = logging.getLogger("pegaflow.server")


class AllInOne:
    """A coordinator and a storage node in one process, with one lifecycle."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.registry = new_registry()
        use_etcd = bool(cfg.etcd.endpoints)
        self.coordinator = Coordinator(
            cfg.coordinator,
            etcd=cfg.etcd if use_etcd else None,
            security=cfg.security,
            index=None if use_etcd else BlockIndex(),
            registry=self.registry,
        )
        self.node = StorageNode(
            cfg.node,
            token=cfg.security.token or None,
            tenant_tokens=cfg.security.tenant_tokens,
            registry=self.registry,
        )
        sink: InventorySink
        if use_etcd:
            from pegaflow.storage_node.publisher import EtcdPublisher

            sink = EtcdPublisher(cfg.etcd, self.node.inventory, registry=self.registry)
        else:
            sink = LocalSink(self.coordinator.index)
        self.node.sink = sink

    async def start(self) -> None:
        await self.coordinator.start()
        if self.coordinator.http_port is not None:
            self.node.http_address = (
                f"{self.cfg.coordinator.http_host}:{self.coordinator.http_port}"
            )
        await self.node.start()

    async def close(self) -> None:
        await self.node.close(unlink=True)
        await self.coordinator.close()

    def ready_line(self) -> str:
        assert self.node.data is not None
        http: Any = self.coordinator.http_port if self.coordinator.http_port is not None else -1
        return (
            f"READY coordinator={self.coordinator.address} node={self.node.node_id} "
            f"ucx={self.cfg.node.host}:{self.node.data.port} http={http}"
        )


async def run(cfg: ClusterConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    server = AllInOne(cfg)
    telemetry.setup(cfg.telemetry, service="pegaflow-server", registry=server.registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except OSError as e:
        await server.close()
        log.error(
            "cannot start: %s (are the ports free? see --coordinator-port, --node-ucx-port)", e
        )
        raise SystemExit(2) from None
    print(server.ready_line(), flush=True)
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        await server.close()
        telemetry.shutdown()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pegaflow-server``."""
    run_service(
        "pegaflow-server",
        __doc__,
        ["etcd", "security", "coordinator", "node", "telemetry"],
        run,
        argv,
    )


if __name__ == "__main__":
    main()
