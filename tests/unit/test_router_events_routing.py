"""A real ``pegaflow-router`` in cache mode on its replicas' KV events, fast: the replicas
are fake-but-real-HTTP (``test_router_failures.FakeReplica``), their KV events come from
vLLM's own ``ZmqEventPublisher`` on real ZMQ sockets.  A request goes to the replica
whose GPU cache holds the longest prefix of its prompt; a view whose replica was sent a
request and published nothing since for ``events_stale_s`` is not used until it does
(the staleness bound of docs/router.md); the hashes are checked against the events'."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.unit.test_router_failures import FakeReplica, _post, _router, _status

kv = pytest.importorskip("vllm.distributed.kv_events")

BS = 4
SEED = "0"
#: The staleness bound: long enough that a busy test machine's pauses stay well inside
#: it, so the confirmations every half bound always land in time.
STALE_S = 2.0


class Engine:
    """One fake replica and its KV events, published by vLLM's own publisher."""

    def __init__(self, name: str, replay: bool = True) -> None:
        from tests.support.kv_events import event_publisher

        self.http = FakeReplica(name).start()
        self.pub, pub, rep = event_publisher(replay)
        self.spec = f"{self.http.url};events=tcp://127.0.0.1:{pub}"
        if replay:
            self.spec += f";replay=tcp://127.0.0.1:{rep}"

    def store(self, tokens: list[int]) -> None:
        """Publish that the engine cached the full blocks of ``tokens``."""
        from pegaflow.router.hashing import BlockHasher, vllm_hash_function

        hasher = BlockHasher(BS, "sha256", SEED, vllm_hash_function("sha256"))
        ev = kv.BlockStored(
            block_hashes=hasher.hashes(tokens), parent_block_hash=None, token_ids=tokens,
            block_size=BS, lora_id=None, medium="GPU", lora_name=None,
        )  # fmt: skip
        self.pub.publish(kv.KVEventBatch(ts=time.time(), events=[ev]))

    def close(self) -> None:
        self.pub.shutdown()
        self.http.stop()


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine]]:
    a, b = Engine("a"), Engine("b", replay=False)
    yield a, b
    for e in (a, b):
        e.close()


def view(url: str, replica: str) -> dict[str, Any]:
    return dict(next(r for r in _status(url)["replicas"] if r["url"] == replica)["gpu_view"])


def wait_view(url: str, replica: str, blocks: int, usable: bool = True) -> None:
    deadline = time.monotonic() + 20
    while (v := view(url, replica))["blocks"] < blocks or v["usable"] != usable:
        assert time.monotonic() < deadline, v
        time.sleep(0.05)


def ask(url: str, tokens: list[int]) -> str:
    status, replica, _ = asyncio.run(_post(url, {"prompt": tokens, "max_tokens": 2}))
    assert status == 200
    return replica


def test_routes_to_the_gpu_holding_the_prefix_within_the_staleness_bound(
    engines: tuple[Engine, Engine],
) -> None:
    a, b = engines
    proc, url = _router(
        f"{a.spec},{b.spec}", "--router-mode", "cache", "--router-block-size", str(BS),
        "--router-hash-seed", SEED, "--router-events-stale-s", str(STALE_S),
        "--router-events-timeout-s", "5",  # a replay answered late on a busy machine counts
        "--router-affinity-memory", "0",
    )  # fmt: skip
    try:
        time.sleep(0.5)  # the subscriptions connect (a PUB socket drops what it sends before)
        doc = list(range(10, 10 + 6 * BS))
        b.store(doc[: 4 * BS])
        wait_view(url, b.http.url, 4)
        assert ask(url, doc) == b.http.url  # B holds 4 blocks, A none
        a.store(doc)  # A now holds all 6
        wait_view(url, a.http.url, 6)
        assert ask(url, doc) == a.http.url
        assert view(url, a.http.url)["hash_check"] == "ok"

        # B has no replay endpoint: a request sent to it and no event since for STALE_S
        # makes its view stale; its next event makes it usable again
        other = list(range(500, 500 + 3 * BS))
        b.store(other)
        wait_view(url, b.http.url, 7)
        assert ask(url, other) == b.http.url
        wait_view(url, b.http.url, 7, usable=False)
        before = _status(url)["counters"].get("miss", 0)
        ask(url, other)
        assert _status(url)["counters"]["miss"] == before + 1  # routed without B's view
        b.store(other[:BS])  # its next event: nothing was lost (no gap)
        wait_view(url, b.http.url, 7)
        assert ask(url, other) == b.http.url

        # A's replay endpoint confirms its view while requests go to it, for longer than
        # the bound: without the confirmations (every STALE_S / 2) the view goes stale
        for i in range(4):
            got = ask(url, doc)
            assert got == a.http.url, (i, view(url, a.http.url), view(url, b.http.url))
            time.sleep(0.4 * STALE_S)
        assert view(url, a.http.url)["usable"], view(url, a.http.url)
        counters = _status(url)["counters"]
        assert counters["affinity"] == 8, counters
    finally:
        proc.terminate()
