"""Coordinators under an etcd rebuilt from empty (same ports, same cluster id), restored,
wiped or compacted past them: they notice and reload their index.

Real processes: an etcd of the test's own (its data dir is wiped), coordinator
processes, and a node's real :class:`~pegaflow.storage_node.publisher.EtcdPublisher`
that republishes its inventory by itself once it finds its lease gone.  One coordinator
is frozen (SIGSTOP) across the change, the other runs through it; both must end up
serving etcd's new truth and agree on its cluster epoch.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from aetcd import rpc
from pegaflow.coordinator.index import BlockIndex
from pegaflow.coordinator.mirror import EtcdMirror

from pegaflow.config import EtcdConfig
from pegaflow.errors import PegaError
from pegaflow.etcd import EtcdClient, delete_op, prefix_range_end
from pegaflow.keys import BlockLocation, Keyspace, NodeRecord
from pegaflow.transport.rpc_client import RpcClient
from tests.support.coordinator_fakes import NS, FakeNode, eventually, h
from tests.support.etcd_fixture import EtcdServer

pytestmark = pytest.mark.etcd


async def _wipe_prefix(etcd: EtcdClient, prefix: bytes) -> None:
    """Delete every key under ``prefix`` (an operator wiping the cluster's keys)."""
    req = rpc.DeleteRangeRequest(key=prefix, range_end=prefix_range_end(prefix))
    await etcd.call(lambda s: s.kv.DeleteRange, req)


async def _write_node(
    etcd: EtcdClient, keys: Keyspace, node_id: str, blocks: Iterable[int]
) -> None:
    """A node record and its block keys written straight to etcd (no lease)."""
    rec = NodeRecord(node_id=node_id, host="127.0.0.1", ucx_port=9000, capacity_bytes=1 << 30)
    await etcd.put(keys.node_key(node_id), rec.encode())
    for i in blocks:
        loc = BlockLocation(node_id, slot=i, gen=1, size=4096, xxh3=i)
        await etcd.put(keys.block_key(NS, h(i), 0), loc.encode())


async def _delete_node(
    etcd: EtcdClient, keys: Keyspace, node_id: str, blocks: Iterable[int]
) -> None:
    """Undo :func:`_write_node`."""
    await etcd.txn(
        [delete_op(keys.node_key(node_id))]
        + [delete_op(keys.block_key(NS, h(i), 0)) for i in blocks]
    )


async def _push_revision(etcd: EtcdClient, past: int) -> int:
    """Write keys outside the cluster prefix until etcd's revision is above ``past``."""
    _, rev = await etcd.count_prefix(b"/filler/")
    while rev <= past:
        await asyncio.gather(*(etcd.put(b"/filler/%d" % i, b"x") for i in range(past - rev + 1)))
        _, rev = await etcd.count_prefix(b"/filler/")
    return rev


async def _hits(client: RpcClient, blocks: Iterable[int]) -> int:
    r = await client.call("lookup", {"ns": NS, "hashes": [h(i) for i in blocks], "shards": [0]})
    return r["hits"]


async def _mirror(client: RpcClient) -> dict[str, Any]:
    return (await client.call("status", {}))["coordinator"]["etcd"]


async def _converge(client: RpcClient, nodes: set[str], hits: dict[range, int], what: str) -> None:
    """Wait until ``client``'s coordinator serves exactly ``nodes`` and ``hits`` (block
    range -> hits expected), connected to etcd and not behind it."""
    want = (nodes, hits, True, 0)
    seen: tuple[Any, ...] = ()

    async def check() -> bool:
        nonlocal seen
        try:
            st = await _mirror(client)
            seen = (
                {n["node_id"] for n in (await client.call("nodes", {}))["nodes"]},
                {blocks: await _hits(client, blocks) for blocks in hits},
                st["etcd_connected"],
                st["lag_revisions"],
            )
        except PegaError as e:  # e.g. slow to answer while it reloads on a loaded host
            seen = (repr(e),)
        return seen == want

    try:
        await eventually(check, timeout=60, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}: want {want}, last seen {seen}") from None


@pytest.mark.parametrize("case", ["rebuilt-ahead", "rebuilt-behind", "compacted"])
async def test_coordinators_converge_after_etcd_is_rebuilt_or_compacted_under_them(
    tmp_path: Path, coordinators: Any, case: str
) -> None:
    """``rebuilt-ahead``: etcd rebuilt from empty, and its revision passed the frozen
    coordinator's last one (only the epoch tells the two apart); ``rebuilt-behind``: its
    revision went back; ``compacted``: etcd restarted on its data and compacted past the
    frozen coordinator's revision."""
    rebuilt = case.startswith("rebuilt")
    server = EtcdServer(tmp_path / "etcd")
    await asyncio.to_thread(server.start)
    cfg = EtcdConfig(
        endpoints=[server.endpoint],
        prefix="/pegaflow/rebuild",
        lease_ttl_s=3,
        timeout_s=2.0,
        batch_size=128,
        flush_interval_ms=2,
    )
    keys = Keyspace(cfg.prefix)
    etcd = EtcdClient(cfg)
    node = FakeNode(cfg, "live")
    clients: list[RpcClient] = []
    frozen = None
    try:
        await node.start()
        node.put(range(200, 204))
        await node.flush()
        await _write_node(etcd, keys, "gone", range(8))  # not in etcd afterwards
        await _push_revision(etcd, 150)

        frozen = await coordinators.start(cfg)
        running = await coordinators.start(cfg)
        clients = [RpcClient([c.address], timeout=5) for c in (frozen, running)]
        before = {range(8): 8, range(200, 204): 4}
        for c in clients:
            await _converge(c, {"gone", "live"}, before, "before")
        old_epochs = {(await _mirror(c)).get("epoch") for c in clients}
        assert len(old_epochs) == 1 and None not in old_epochs and "" not in old_epochs

        os.kill(frozen.pid, signal.SIGSTOP)
        _, old_rev = await etcd.count_prefix(b"/")
        await asyncio.to_thread(server.kill)
        if rebuilt:
            shutil.rmtree(server.data_dir)
        await asyncio.to_thread(server.start)
        await etcd.close()  # a fresh channel: the old one may still back off for a while
        etcd = EtcdClient(cfg)

        # The truth now: a node that was never there before, "gone" gone, and the live
        # node, which evicts two blocks meanwhile (and republishes into a rebuilt etcd
        # by itself).
        if not rebuilt:
            await _delete_node(etcd, keys, "gone", range(8))
        await _write_node(etcd, keys, "fresh", range(100, 108))
        node.evict([202, 203])
        after = {range(8): 0, range(100, 108): 8, range(200, 204): 2}
        await _converge(clients[1], {"fresh", "live"}, after, "running coordinator")
        if case == "rebuilt-behind":
            _, rev = await etcd.count_prefix(b"/")
            assert rev < old_rev
        else:
            rev = await _push_revision(etcd, old_rev + 20)
            if case == "compacted":
                await etcd.compact(rev)
        os.kill(frozen.pid, signal.SIGCONT)
        await _converge(clients[0], {"fresh", "live"}, after, "frozen coordinator")

        states = [await _mirror(c) for c in clients]
        epochs = {st["epoch"] for st in states}
        assert len(epochs) == 1, states
        if rebuilt:  # a new etcd, a new epoch, and both reloaded from it
            assert not epochs & old_epochs, states
            assert all(st["reloads"] >= 1 for st in states), states
        else:
            assert epochs == old_epochs, states
            assert states[0]["reloads"] >= 1 and "compacted" in states[0]["last_reload"]
        if case == "rebuilt-ahead":  # the running one made a new epoch before it woke up
            assert "epoch" in states[0]["last_reload"], states[0]
        # Both keep following etcd.
        await _write_node(etcd, keys, "fresh", range(108, 110))
        for c in clients:
            await _converge(c, {"fresh", "live"}, {range(100, 110): 10}, "watch after reload")
    finally:
        if frozen is not None and frozen.alive():
            os.kill(frozen.pid, signal.SIGCONT)
        for c in clients:
            await c.close()
        await node.publisher.close()
        await etcd.close()
        await asyncio.to_thread(server.kill)


async def test_mirror_reloads_when_the_epoch_changes_on_its_watch(etcd_config: EtcdConfig) -> None:
    """The epoch deleted (the cluster prefix wiped) or rewritten (a backup of another
    cluster restored) while the watch runs: the mirror reloads and takes the new epoch."""
    keys = Keyspace(etcd_config.prefix)
    etcd = EtcdClient(etcd_config)
    index = BlockIndex()
    mirror = EtcdMirror(etcd, keys, index)

    def lookup(blocks: range) -> int:
        return index.lookup(NS, [h(i) for i in blocks], [0]).hits

    async def reloaded(n: int) -> bool:
        return mirror.reloads == n and mirror.connected

    try:
        await _write_node(etcd, keys, "a", range(4))
        assert await mirror.start(wait_s=10)
        first = mirror.epoch
        assert first and (await etcd.get(keys.epoch_key)).value.decode() == first
        assert lookup(range(4)) == 4

        await _wipe_prefix(etcd, f"{keys.prefix}/".encode())
        await eventually(lambda: reloaded(1), what="reload after the prefix was wiped")
        assert mirror.epoch not in ("", first) and lookup(range(4)) == 0
        assert (await etcd.get(keys.epoch_key)).value.decode() == mirror.epoch

        await _write_node(etcd, keys, "b", range(10, 12))
        await etcd.put(keys.epoch_key, b"restored")
        await eventually(lambda: reloaded(2), what="reload after the epoch was rewritten")
        assert mirror.epoch == "restored" and lookup(range(10, 12)) == 2
        assert mirror.status()["reloads"] == 2 and "restored" in mirror.last_reload
    finally:
        await mirror.close()
        await etcd.close()


async def test_put_if_absent_lets_concurrent_callers_agree(etcd_config: EtcdConfig) -> None:
    etcd = EtcdClient(etcd_config)
    key = Keyspace(etcd_config.prefix).epoch_key
    try:
        got = await asyncio.gather(*(etcd.put_if_absent(key, b"v%d" % i) for i in range(8)))
        assert len({value for value, _ in got}) == 1
        assert sum(created for _, created in got) == 1
        assert (await etcd.get(key)).value == got[0][0]
    finally:
        await etcd.close()
