"""``pegaflow-node``: run one storage node.

With ``[etcd] endpoints`` set, the node joins the cluster (membership and inventory in
etcd under its lease); without, it serves standalone (useful for benchmarks) and says so.
Prints ``READY node=<id> ucx=<host:port> http=<port>`` once serving.  A start that
fails (a pool larger than the memory or ``shm_dir`` left for it, a port taken, a bad
address, a node id held by another live node, an unknown ``[node] access_group``) logs
why in one line and exits with status 2, leaving no file it created behind.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from pegaflow.storage_node.node import NullSink, StorageNode

from pegaflow.config import ClusterConfig
from pegaflow.inventory import InventorySink, NodeIdInUse
from pegaflow.observability import telemetry
from pegaflow.service import run_service, taken_ports

log = logging.getLogger("pegaflow.node")


def make_sink(cfg: ClusterConfig, node: StorageNode) -> InventorySink:
    """etcd publishing when etcd is configured, else nothing (standalone)."""
    if not cfg.etcd.endpoints:
        log.warning(
            "no [etcd] endpoints: serving standalone, no coordinator will find these blocks"
        )
        return NullSink()
    from pegaflow.storage_node.publisher import EtcdPublisher

    return EtcdPublisher(cfg.etcd, node.inventory, registry=node.registry)


async def run(cfg: ClusterConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    node = StorageNode(
        cfg.node, token=cfg.security.token or None, tenant_tokens=cfg.security.tenant_tokens
    )
    node.sink = make_sink(cfg, node)
    telemetry.setup(cfg.telemetry, service="pegaflow-node", registry=node.registry)
    loop = asyncio.get_running_loop()
    starting = asyncio.current_task()
    assert starting is not None
    for sig in (signal.SIGINT, signal.SIGTERM):  # stopped while starting: clean up, exit
        loop.add_signal_handler(sig, starting.cancel)
    try:
        await node.start()
    except (OSError, ValueError, NodeIdInUse) as e:  # port taken, pool file in use, shm full
        hint = taken_ports([(cfg.node.host, cfg.node.ucx_port, "--node-ucx-port")])
        log.error("cannot start node: %s%s", e, f" ({hint})" if hint else "")
        raise SystemExit(2) from None
    except asyncio.CancelledError:
        log.info("stopped while starting")
        raise SystemExit(1) from None
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    http = None
    if cfg.node.http_port >= 0:
        from pegaflow.observability.http import start_http

        try:
            http = await start_http(
                cfg.node.http_host,
                cfg.node.http_port,
                status=node.status,
                health=node.health,
                registry=node.registry,
            )
        except OSError as e:
            log.error("cannot start node: HTTP endpoint: %s (see --node-http-port)", e)
            await node.close(unlink=node.pool_created)
            raise SystemExit(2) from None
        node.http_address = f"{cfg.node.http_host}:{http.port}"
        await node.sink.update_node(node.record())
    http_port = http.port if http else -1
    print(
        f"READY node={node.node_id} ucx={cfg.node.host}:{node.ucx_port} http={http_port}",
        flush=True,
    )
    await stop.wait()
    log.info("stopping node %s", node.node_id)
    if http is not None:
        await http.close()
    await node.close(unlink=not cfg.node.keep_pool)
    telemetry.shutdown()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pegaflow-node``."""
    run_service("pegaflow-node", __doc__, ["etcd", "security", "node", "telemetry"], run, argv)


if __name__ == "__main__":
    main()
