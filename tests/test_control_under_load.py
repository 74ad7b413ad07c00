"""The control plane under bulk data: a default ``pegaflow-server`` (coordinator and node
in one process, one event loop) answers lookups within their deadline while it streams
large gets to other clients, over UCX's TCP transport and the default ones."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pegaflow.client import PegaClient

from pegaflow.config import ClientConfig
from pegaflow.devcluster import start_server
from pegaflow.errors import PegaError
from tests.test_cluster import NS

LOOKUP_DEADLINE_S = 0.25
"""the connector's default is 50 ms; a loaded 2-core CI machine gets some slack"""


@pytest.mark.parametrize("tls", ["tcp", "default"])
async def test_lookups_answer_within_their_deadline_while_the_server_streams_gets(
    tls: str,
) -> None:
    env = {"UCX_TLS": "tcp"} if tls == "tcp" else None
    ucx = {"TLS": "tcp"} if tls == "tcp" else None
    srv = start_server(extra=["--node-pool-bytes", "512MiB", "--node-slab-bytes", "32MiB"], env=env)
    coord, node = srv.ready["coordinator"], srv.ready["node"]
    bulk = PegaClient(ClientConfig(coordinators=[coord], local_node=node))
    bulk._data._ucx_config = ucx
    looker = PegaClient(ClientConfig(coordinators=[coord], lookup_timeout_s=LOOKUP_DEADLINE_S))
    rng = np.random.default_rng(7)
    data = rng.integers(0, 255, size=(24, 8 << 20), dtype=np.uint8)
    hashes = [bytes([7, i]) * 16 for i in range(24)]
    stop = asyncio.Event()
    moved = 0

    async def stream() -> None:
        nonlocal moved
        out = np.zeros_like(data)
        items = [(node, h, 0, out[i]) for i, h in enumerate(hashes)]
        while not stop.is_set():
            moved += sum(await bulk.get_blocks(NS, items, timeout=10))

    try:
        for i in range(0, 24, 8):
            part = [(h, 0, data[i + j]) for j, h in enumerate(hashes[i : i + 8])]
            assert (await bulk.put_blocks(NS, part, node_id=node)).stored == 8
        assert (await looker.lookup(NS, hashes)).hits == 24
        streams = [asyncio.create_task(stream()) for _ in range(2)]
        await asyncio.sleep(0.3)
        failed: list[str] = []
        for _ in range(100):
            try:
                assert (await looker.lookup(NS, hashes)).hits == 24
            except PegaError as e:
                failed.append(str(e))
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.gather(*streams)
        assert moved > 24, "the gets did not stream"
        assert not failed, failed[:3]
    finally:
        stop.set()
        await bulk.close()
        await looker.close()
        srv.terminate()
