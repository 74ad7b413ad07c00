"""A storage node: pool + data server + inventory publishing + HTTP, with one lifecycle."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pegaflow.storage_node.data_server import DataServer
from pegaflow.storage_node.metrics import NodeMetrics
from pegaflow.storage_node.pool import BlockPool, Entry
from prometheus_client import CollectorRegistry

from pegaflow import __version__
from pegaflow.auth import Authenticator
from pegaflow.config import NodeConfig
from pegaflow.inventory import InventorySink
from pegaflow.keys import BlockLocation, NodeRecord

log = logging.getLogger(__name__)


class NullSink:
    """An InventorySink that publishes nowhere (a node without any index)."""

    async def start(self, record: NodeRecord) -> None:
        pass

    async def update_node(self, record: NodeRecord) -> None:
        pass

    def publish(self, ns: str, block_hash: bytes, shard: int, loc: BlockLocation) -> None:
        pass

    def unpublish(self, ns: str, block_hash: bytes, shard: int, loc: BlockLocation) -> None:
        pass

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass


class StorageNode:
    """Owns a :class:`BlockPool`, serves it over UCX and publishes it to a sink.

    ``await start()`` brings everything up in order (pool, data server, membership);
    ``await close()`` takes it down in reverse.  ``sink`` decides where the inventory
    goes (etcd in a cluster, the embedded coordinator's index in ``pegaflow-server``).
    """

    def __init__(
        self,
        cfg: NodeConfig,
        sink: InventorySink | None = None,
        *,
        token: str | None = None,
        tenant_tokens: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.cfg = cfg
        self.sink: InventorySink = sink if sink is not None else NullSink()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = NodeMetrics(self.registry)
        self._auth = Authenticator(token, tenant_tokens)
        self.pool: BlockPool | None = None
        self.data: DataServer | None = None
        self.node_id = cfg.node_id
        self.started_at = time.time()
        self._refresh: asyncio.Task[None] | None = None
        self._dirty = asyncio.Event()
        self.http_address = ""

    def record(self) -> NodeRecord:
        """This node as published in the index."""
        assert self.pool is not None and self.data is not None
        st = self.pool.stats()
        return NodeRecord(
            node_id=self.node_id,
            host=self.cfg.host,
            ucx_port=self.data.port,
            http=self.http_address,
            capacity_bytes=st.capacity_bytes,
            used_bytes=st.used_bytes,
            blocks=st.blocks,
            started_at=self.started_at,
            version=__version__,
        )

    def _on_evict(self, e: Entry) -> None:
        self.sink.unpublish(e.key[0], e.key[1], e.key[2], e.location(self.node_id))
        self._dirty.set()

    def inventory(self) -> list[tuple[str, bytes, int, BlockLocation]]:
        """Every committed block, for a full republish."""
        assert self.pool is not None
        return [
            (e.key[0], e.key[1], e.key[2], e.location(self.node_id)) for e in self.pool.committed()
        ]

    async def start(self) -> None:
        cfg = self.cfg
        self.data = None
        if not self.node_id:
            if cfg.ucx_port:
                self.node_id = f"{socket.gethostname()}-{cfg.ucx_port}"
            else:  # a port picked by the OS says nothing stable: make the id unique
                self.node_id = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
                log.warning(
                    "no [node] node_id and ucx_port 0: using %s; set node_id so that a "
                    "restart finds this pool again",
                    self.node_id,
                )
        path = Path(cfg.shm_dir) / f"pegaflow-{self.node_id}.pool"
        self.pool = BlockPool(
            path, cfg.pool_bytes, cfg.slab_bytes, node_id=self.node_id, on_evict=self._on_evict
        )
        self.update_gauges()  # capacity is known now, not only after the first change
        self.data = DataServer(
            self.pool, cfg, self.sink, self.metrics, auth=self._auth, on_change=self._dirty.set
        )
        await self.data.start()
        if not cfg.node_id and cfg.ucx_port == 0:
            log.info("node id %s (set [node] node_id to keep it stable)", self.node_id)
        await self.sink.start(self.record())
        if self.pool.recovered:
            for e in self.pool.recovered:
                self.sink.publish(e.key[0], e.key[1], e.key[2], e.location(self.node_id))
            log.info("re-attached %d verified blocks from %s", len(self.pool.recovered), path)
            self.update_gauges()
        self._refresh = asyncio.create_task(self._refresh_loop())
        log.info(
            "node %s serving %d MiB on UCX %s:%d",
            self.node_id,
            self.pool.capacity >> 20,
            cfg.host,
            self.data.port,
        )

    async def _refresh_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            self.update_gauges()
            try:
                await self.sink.update_node(self.record())
            except Exception:
                log.warning("could not refresh the node record", exc_info=True)
            await asyncio.sleep(1.0)

    def update_gauges(self) -> None:
        assert self.pool is not None
        st = self.pool.stats()
        m = self.metrics
        m.capacity_bytes.set(st.capacity_bytes)
        m.used_bytes.set(st.used_bytes)
        m.blocks.set(st.blocks)
        m.evictions.set(st.evictions)

    async def status(self) -> dict[str, Any]:
        """The /v1/status document of this node."""
        assert self.pool is not None
        return {"node": self.record().to_wire(), "pool": vars(self.pool.stats())}

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy when the pool is mapped and the data server listens."""
        ok = self.pool is not None and self.data is not None
        return ok, {"node_id": self.node_id, "serving": ok}

    async def close(self, unlink: bool = True) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        await self.sink.close()
        if self.data is not None:
            await self.data.close()
        if self.pool is not None:
            self.pool.close(unlink=unlink)
