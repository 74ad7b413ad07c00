"""``pegaflow-node``: run one storage node.

With ``[etcd] endpoints`` set, the node joins the cluster (membership and inventory in
etcd under its lease); without, it serves standalone (useful for benchmarks) and says so.
Prints ``READY node=<id> ucx=<host:port> http=<port>`` once serving.  A start that
fails (a pool larger than the memory or ``shm_dir`` left for it, a port taken, a bad
address, a node id held by another live node, an unknown ``[node] access_group``, no
``ucxx``: the ``cu12`` or ``cu13`` extra) logs why in one line and exits with status 2,
leaving no file it created behind.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pegaflow.auth import cluster_token, tenant_tokens
from pegaflow.config import ClusterConfig
from pegaflow.inventory import InventorySink, NodeIdInUse
from pegaflow.runner import Runner, run_service

if TYPE_CHECKING:
    from pegaflow.storage_node.node import StorageNode

log = logging.getLogger("pegaflow.node")


def make_sink(cfg: ClusterConfig, node: StorageNode) -> InventorySink:
    """etcd publishing when etcd is configured, else nothing (standalone)."""
    if not cfg.etcd.endpoints:
        from pegaflow.storage_node.node import NullSink

        log.warning(
            "no [etcd] endpoints: serving standalone, no coordinator will find these blocks"
        )
        return NullSink()
    from pegaflow.storage_node.publisher import EtcdPublisher

    return EtcdPublisher(cfg.etcd, node.inventory, registry=node.registry)


async def start(cfg: ClusterConfig, run: Runner) -> str:
    """Start the node and its HTTP site; its READY line."""
    # imported here, not at the top: without ucxx, --help works and a start fails in one
    # line naming the extra to install (UcxNotInstalled)
    from pegaflow.storage_node.node import StorageNode

    node = StorageNode(
        cfg.node, token=cluster_token(cfg.security), tenant_tokens=tenant_tokens(cfg.security)
    )
    node.sink = make_sink(cfg, node)
    run.telemetry(node.registry)
    try:
        await run.enter(node.start(), node.close_at_exit)
    except (OSError, ValueError, NodeIdInUse) as e:  # port taken, pool file in use, shm full
        run.fail_on_ports("cannot start node", e, [
            (cfg.node.host, cfg.node.ucx_port, "--node-ucx-port"),
        ])  # fmt: skip
    http_port = -1
    if cfg.node.http_port >= 0:
        try:
            http = await run.http(
                cfg.node.http_host,
                cfg.node.http_port,
                status=node.status,
                health=node.health,
                registry=node.registry,
            )
        except OSError as e:
            run.fail("cannot start node: HTTP endpoint: %s (see --node-http-port)", e)
        http_port = http.port
        node.http_address = f"{cfg.node.http_host}:{http_port}"
        await node.sink.update_node(node.record())
    run.stopping = f"stopping node {node.node_id}"
    return f"READY node={node.node_id} ucx={cfg.node.host}:{node.ucx_port} http={http_port}"


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pegaflow-node``."""
    run_service("pegaflow-node", __doc__, ["etcd", "security", "node", "telemetry"], start, argv)


if __name__ == "__main__":
    main()
