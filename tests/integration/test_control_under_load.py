"""The control plane under bulk data.  While the same process streams large gets to one
client and takes large puts from another, its control ops answer within their
deadlines:

* a default ``pegaflow-server`` (coordinator and node in one process; the coordinator on
  an event loop of its own): lookups, locates over the same-host control socket and
  over UCX, and read pins; over UCX's TCP transport and the default ones;
* a ``pegaflow-node`` of a cluster (etcd and a coordinator process): locates and pins.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from pegaflow.client import PegaClient

from pegaflow.config import ClientConfig, EtcdConfig
from pegaflow.errors import PegaError
from pegaflow.tools.devcluster import start_node, start_server
from tests.support.cluster import NS
from tests.support.etcd_fixture import CoordinatorFactory

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]

DEADLINE_S = 0.25
"""of every control op; the connector's lookup deadline is 50 ms, and a loaded 2-core CI
machine gets some slack"""
BLOCK = 8 << 20
READ_SET = 24
ROUNDS = 60

Op = Callable[[], Awaitable[None]]


async def _control_under_load(
    coord: str, node: str, ops: dict[str, Callable[[PegaClient, list[bytes]], Op]], ucx: dict
) -> None:
    """Store the read set, then stream gets and puts at ``node`` while each control op
    runs ``ROUNDS`` times under ``DEADLINE_S``; every op must succeed every time."""
    cfg = ClientConfig(coordinators=[coord], local_node=node, rpc_timeout_s=10)
    reader, writer = PegaClient(cfg), PegaClient(cfg)
    for c in (reader, writer):
        c._data._ucx_config = ucx or None
    control = PegaClient(ClientConfig(coordinators=[coord], lookup_timeout_s=DEADLINE_S))
    remote = PegaClient(ClientConfig(coordinators=[coord], local_control=False))
    remote._data._ucx_config = ucx or None
    rng = np.random.default_rng(7)
    data = rng.integers(0, 255, size=(READ_SET, BLOCK), dtype=np.uint8)
    hashes = [bytes([7, i]) * 16 for i in range(READ_SET)]
    stop = asyncio.Event()
    moved = {"got": 0, "put": 0}

    async def gets() -> None:
        out = np.zeros_like(data)
        items = [(node, h, 0, out[i]) for i, h in enumerate(hashes)]
        while not stop.is_set():
            moved["got"] += sum(await reader.get_blocks(NS, items, timeout=10))

    async def puts() -> None:
        fresh = itertools.count()
        while not stop.is_set():
            part = [(i.to_bytes(8, "big") * 4, 0, data[i % READ_SET])
                    for i in itertools.islice(fresh, 4)]  # fmt: skip
            moved["put"] += (await writer.put_blocks(NS, part, node_id=node, timeout=10)).stored

    clients = {"control": control, "remote": remote}
    try:
        for i in range(0, READ_SET, 8):
            part = [(h, 0, data[i + j]) for j, h in enumerate(hashes[i : i + 8])]
            assert (await writer.put_blocks(NS, part, node_id=node)).stored == 8
        runs = {name: make(clients["remote" if "ucx" in name else "control"], hashes)
                for name, make in ops.items()}  # fmt: skip
        for run in runs.values():  # connections made, pools found: before the load
            await run()
        bulk = [asyncio.create_task(gets()), asyncio.create_task(puts())]
        await asyncio.sleep(0.3)
        failed: list[str] = []
        for _ in range(ROUNDS):
            for name, run in runs.items():
                try:
                    await run()
                except (PegaError, AssertionError) as e:
                    failed.append(f"{name}: {type(e).__name__}: {e}")
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.gather(*bulk)
        assert moved["got"] > READ_SET and moved["put"] > 4, f"bulk did not stream: {moved}"
        assert not failed, f"{len(failed)} failed: {failed[:4]}"
    finally:
        stop.set()
        for c in (reader, writer, control, remote):
            await c.close()


def _lookup(c: PegaClient, hashes: list[bytes]) -> Op:
    async def run() -> None:
        assert (await c.lookup(NS, hashes)).hits == len(hashes)

    return run


def _locate(node: str) -> Callable[[PegaClient, list[bytes]], Op]:
    def make(c: PegaClient, hashes: list[bytes]) -> Op:
        async def run() -> None:
            pin, where = await c.locate(NS, node, hashes, 0, 5.0, DEADLINE_S)
            assert bool(where.found.all())
            await c.unpin(node, pin, DEADLINE_S)

        return run

    return make


def _pin(node: str) -> Callable[[PegaClient, list[bytes]], Op]:
    def make(c: PegaClient, hashes: list[bytes]) -> Op:
        async def run() -> None:
            ok = await c.pin_blocks(NS, [(node, h, 0) for h in hashes], 1.0, DEADLINE_S)
            assert all(ok)

        return run

    return make


@pytest.mark.parametrize("tls", ["tcp", "default"])
async def test_a_servers_control_ops_answer_within_their_deadline_under_bulk_data(
    tls: str,
) -> None:
    env = {"UCX_TLS": "tcp"} if tls == "tcp" else None
    ucx = {"TLS": "tcp"} if tls == "tcp" else {}
    srv = start_server(extra=["--node-pool-bytes", "768MiB", "--node-slab-bytes", "32MiB"], env=env)
    coord, node = srv.ready["coordinator"], srv.ready["node"]
    ops = {
        "lookup": _lookup,
        "locate (control socket)": _locate(node),
        "locate (ucx)": _locate(node),
        "pin (ucx)": _pin(node),
    }
    try:
        await _control_under_load(coord, node, ops, ucx)
    finally:
        srv.terminate()


async def test_a_cluster_nodes_locates_and_pins_answer_within_their_deadline_under_bulk_data(
    etcd_config: EtcdConfig, coordinators: CoordinatorFactory
) -> None:
    coord = await coordinators.start(etcd_config)
    node = start_node(
        "bulk",
        etcd=etcd_config.endpoints[0],
        prefix=etcd_config.prefix,
        pool="768MiB",
        slab="32MiB",
    )
    ops = {"locate (control socket)": _locate("bulk"), "pin (ucx)": _pin("bulk")}
    try:
        probe = PegaClient(ClientConfig(coordinators=[coord.address]))
        for _ in range(150):
            if "bulk" in await probe.nodes():
                break
            await asyncio.sleep(0.1)
        await probe.close()
        await _control_under_load(coord.address, "bulk", ops, {})
    finally:
        node.kill()
