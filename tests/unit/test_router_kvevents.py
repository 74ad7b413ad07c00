"""The router's view of each replica's GPU cache from vLLM's KV events: vLLM's own
``KVEventBatch`` structs, published by vLLM's own ``ZmqEventPublisher`` on real ZMQ
sockets, read by :class:`~pegaflow.router.kvevents.Subscription`: stores and removals
followed, history replayed at start, a gap filled from the replay endpoint or (when it
cannot be) the view cleared, a restarted engine's view cleared, the router's hashes
checked against the engine's, bad payloads refused; then the scoring by tier."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import pytest
from pegaflow.router.hashing import BlockHasher, vllm_hash_function
from pegaflow.router.kvevents import (
    BadEvent,
    GpuView,
    Stored,
    Subscription,
    block_key,
    decode_batch,
)
from pegaflow.router.policy import Replica, TierWeights, parse_replica, tier_scores

from pegaflow.errors import BadRequest

kv = pytest.importorskip("vllm.distributed.kv_events")

from tests.support.kv_events import event_publisher  # noqa: E402

BS = 4
HASHER = BlockHasher(BS, "sha256", "0")


def tokens(n_blocks: int, seed: int = 0) -> list[int]:
    return [(seed * 1000 + i) % 997 for i in range(n_blocks * BS)]


def stored(tok: list[int], parent: bytes | None = None, medium: str = "GPU") -> Any:
    """vLLM's ``BlockStored`` for the full blocks of ``tok`` after ``parent``."""
    hashes = chain(tok, parent)
    return kv.BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tok, block_size=BS,
        lora_id=None, medium=medium, lora_name=None,
    )  # fmt: skip


def chain(tok: list[int], parent: bytes | None = None) -> list[bytes]:
    """The engine's hashes of ``tok``'s blocks (vLLM's own function), after ``parent``."""
    fn = vllm_hash_function("sha256")
    assert fn is not None
    h = parent or fn("0")
    out = []
    for i in range(0, len(tok), BS):
        h = fn((h, tuple(tok[i : i + BS]), None))
        out.append(h)
    return out


def batch(*events: Any) -> Any:
    return kv.KVEventBatch(ts=time.time(), events=list(events))


def encode(b: Any) -> bytes:
    import msgspec

    return bytes(msgspec.msgpack.Encoder().encode(b))


# ---- decoding --------------------------------------------------------------------------


def test_decode_vllm_batches() -> None:
    tok = tokens(2)
    hashes = chain(tok)
    got = decode_batch(
        encode(batch(stored(tok), kv.BlockRemoved(block_hashes=[7], medium="CPU"),
                     kv.AllBlocksCleared()))
    )  # fmt: skip
    s, r, c = got
    assert isinstance(s, Stored) and list(s.hashes) == hashes and s.parent is None
    assert s.token_ids == tuple(tok) and s.plain and s.medium == "GPU"
    assert (r.hashes, r.medium) == ((7,), "CPU")
    assert type(c).__name__ == "Cleared"
    lora = kv.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1] * BS,
                          block_size=BS, lora_id=3, medium="GPU", lora_name="a")  # fmt: skip
    assert not decode_batch(encode(batch(lora)))[0].plain


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgpack.packb({"ts": 1}),  # not an array
        msgpack.packb([1.0, [["BlockStored"]]]),  # an event that is not a map
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1.5]}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved"}]]),
    ],
)
def test_bad_payloads_are_typed_errors(payload: bytes) -> None:
    with pytest.raises(BadEvent):
        decode_batch(payload)


def test_unknown_event_types_are_skipped() -> None:
    assert decode_batch(msgpack.packb([1.0, [{"type": "Tomorrow", "x": 1}]])) == []


# ---- the view --------------------------------------------------------------------------


def test_view_follows_stores_and_removals_and_is_bounded() -> None:
    view = GpuView(capacity=6, stale_s=2.0)
    tok = tokens(4)
    keys = [block_key(h) for h in chain(tok)]
    view.apply(decode_batch(encode(batch(stored(tok)))))
    assert view.prefix(keys) == 4
    view.apply(decode_batch(encode(batch(stored(tok, medium="CPU")))))  # another medium
    removed = kv.BlockRemoved(block_hashes=[chain(tok)[2]], medium="GPU")
    view.apply(decode_batch(encode(batch(removed))))
    assert view.prefix(keys) == 2  # a prefix stops at the first block not held
    other = tokens(4, seed=1)
    view.apply(decode_batch(encode(batch(stored(other)))))
    assert len(view) == 6  # bounded: the oldest stored forgotten first
    assert view.prefix([block_key(h) for h in chain(other)]) == 4 and view.prefix(keys) == 0
    view.apply(decode_batch(encode(batch(kv.AllBlocksCleared()))))
    assert len(view) == 0
    # 64-bit integer hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) match the same keys
    ints = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in chain(tok)]
    ev = kv.BlockStored(block_hashes=ints, parent_block_hash=None, token_ids=tok, block_size=BS,
                        lora_id=None, medium="GPU", lora_name=None)  # fmt: skip
    view.apply(decode_batch(encode(batch(ev))))
    assert view.prefix(keys) == 4


def test_view_staleness_bound() -> None:
    view = GpuView(capacity=10, stale_s=2.0)
    assert not view.usable(100.0)  # no batch yet
    view.next_seq, view.confirmed_at = 5, 100.0
    assert view.usable(100.5)
    view.touch(101.0)  # a request sent after the last confirmation: the bound runs from it
    view.touch(102.5)
    assert view.usable(102.9) and not view.usable(103.1)
    view.confirmed_at = 103.2
    assert view.usable(110.0)
    view.touch(120.0)  # confirmed long ago, touched now: not stale before 122
    assert view.usable(121.9) and not view.usable(122.1)
    view.hash_check = "mismatch"
    assert not view.usable(110.0)


def test_hash_check() -> None:
    tok = tokens(3)
    hashes = chain(tok)
    assert HASHER.check(None, tok, hashes) is True
    assert HASHER.check(hashes[0], tok[BS:], hashes[1:]) is True
    assert HASHER.check(None, tok, [int.from_bytes(h[-8:], "big") for h in hashes]) is True
    assert BlockHasher(BS, "sha256", "1").check(None, tok, hashes) is False  # another seed
    assert HASHER.check(None, tok[:-1], hashes) is None  # not whole blocks
    assert HASHER.check(5, tok, hashes) is None  # an integer parent: cannot chain


# ---- real ZMQ: vLLM's publisher, the router's subscription -----------------------------


class Engine:
    """vLLM's own ``ZmqEventPublisher`` (PUB + replay ROUTER) on loopback ports."""

    def __init__(self, replay: bool = True) -> None:
        self.pub, self.port, self.replay_port = event_publisher(replay)
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.replay = f"tcp://127.0.0.1:{self.replay_port}" if replay else ""

    def publish(self, *events: Any) -> None:
        self.pub.publish(batch(*events))

    def close(self) -> None:
        self.pub.shutdown()


async def until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def subscribed(engine: Engine, view: GpuView, **kw: Any) -> AsyncIterator[Subscription]:
    outcomes: list[str] = []
    sub = Subscription(
        "r", engine.endpoint, engine.replay, view,
        lambda ev: HASHER.check(ev.parent, ev.token_ids, ev.hashes), 2.0,
        on_batch=outcomes.append, **kw,
    )  # fmt: skip
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_subscription_replays_history_then_follows() -> None:
    engine = Engine()
    try:
        a, b = tokens(3, seed=1), tokens(2, seed=2)
        engine.publish(stored(a))  # before the router subscribes
        engine.publish(stored(b))
        await asyncio.sleep(0.3)
        view = GpuView(capacity=100, stale_s=2.0)
        ka, kb = [block_key(h) for h in chain(a)], [block_key(h) for h in chain(b)]
        async with subscribed(engine, view):
            await asyncio.sleep(0.5)  # the SUB connects (PUB drops what it sends before)
            c = tokens(1, seed=3)
            engine.publish(stored(c))  # seq 2: the first seen; 0 and 1 come from replay
            await until(lambda: view.next_seq == 3)
            assert view.prefix(ka) == 3 and view.prefix(kb) == 2 and view.hash_check == "ok"
            engine.publish(kv.BlockRemoved(block_hashes=[chain(a)[1]], medium="GPU"))
            await until(lambda: view.prefix(ka) == 1)
            assert view.usable(time.monotonic())
    finally:
        engine.close()


async def test_gap_is_replayed_or_clears_the_view() -> None:
    for replay in (True, False):
        engine = Engine(replay=replay)
        try:
            view = GpuView(capacity=100, stale_s=2.0)
            sub = Subscription("r", engine.endpoint, engine.replay, view, lambda ev: True, 2.0)
            a = tokens(2, seed=4)
            engine.publish(stored(a))
            await asyncio.sleep(0.3)
            await sub.receive([b"", (0).to_bytes(8, "big"), encode(batch(stored(a)))])
            assert view.next_seq == 1 and view.prefix([block_key(h) for h in chain(a)]) == 2
            # batch 1 (removing a's first block) is lost on the way; batch 2 arrives
            engine.publish(kv.BlockRemoved(block_hashes=[chain(a)[0]], medium="GPU"))
            b = tokens(1, seed=5)
            engine.publish(stored(b))
            await asyncio.sleep(0.3)
            await sub.receive([b"", (2).to_bytes(8, "big"), encode(batch(stored(b)))])
            assert view.next_seq == 3
            assert view.prefix([block_key(chain(b)[0])]) == 1
            assert view.prefix([block_key(h) for h in chain(a)]) == 0  # never claims a removed
            assert view.resyncs == (0 if replay else 1)
            assert len(view) == (1 if not replay else 2)  # cleared: only what came after
        finally:
            engine.close()


async def test_restart_and_bad_messages_clear_the_view() -> None:
    view = GpuView(capacity=100, stale_s=2.0)
    sub = Subscription("r", "tcp://127.0.0.1:1", "", view, lambda ev: True, 0.5)
    a = tokens(2, seed=6)
    for seq in (0, 1):
        await sub.receive([b"", seq.to_bytes(8, "big"), encode(batch(stored(a)))])
    assert view.next_seq == 2 and len(view) == 2
    b = tokens(1, seed=7)
    await sub.receive([b"", (0).to_bytes(8, "big"), encode(batch(stored(b)))])  # restarted
    assert view.restarts == 1 and len(view) == 1 and view.next_seq == 1
    await sub.receive([b"", (1).to_bytes(8, "big"), b"\xc1garbage"])
    assert sub.bad == 1 and len(view) == 0 and view.next_seq == 2
    await sub.receive([b"only one frame"])
    assert sub.bad == 2


async def test_hash_mismatch_disables_the_view() -> None:
    view = GpuView(capacity=100, stale_s=2.0)
    other = BlockHasher(BS, "sha256", "another-seed")
    sub = Subscription("r", "tcp://127.0.0.1:1", "", view,
                       lambda ev: other.check(ev.parent, ev.token_ids, ev.hashes), 0.5)  # fmt: skip
    await sub.receive([b"", (0).to_bytes(8, "big"), encode(batch(stored(tokens(2))))])
    assert view.hash_check == "mismatch" and not view.usable(time.monotonic())


async def test_a_quiet_replay_confirms_a_pending_view() -> None:
    """A replica sent requests whose events are all in: the periodic replay check
    (nothing new after the last batch) keeps its view usable past ``stale_s``."""
    engine = Engine()
    try:
        view = GpuView(capacity=100, stale_s=0.4)
        async with subscribed(engine, view):
            await asyncio.sleep(0.5)
            engine.publish(stored(tokens(1, seed=8)))
            await until(lambda: view.next_seq == 1)
            view.touch(time.monotonic())
            await asyncio.sleep(1.0)  # 2.5 x stale_s: confirmed by replay meanwhile
            assert view.usable(time.monotonic()), view.status()
    finally:
        engine.close()


# ---- replicas and scores ---------------------------------------------------------------


def test_replica_spec_events_keys() -> None:
    r = parse_replica("http://h:8000;events=tcp://h:5557;replay=tcp://h:5558")
    assert (r.events, r.replay) == ("tcp://h:5557", "tcp://h:5558")
    for bad in ("http://h:8000;events=h:5557", "http://h:8000;replay=tcp://h:5558"):
        with pytest.raises(BadRequest):
            parse_replica(bad)


def test_tier_scores() -> None:
    a, b, c = (Replica(f"http://{n}:1") for n in "abc")
    w = TierWeights(pool=0.8, remote=0.5)
    # a holds 4 blocks on its GPU; b's host node holds the 6 stored; c nothing of its own
    s = tier_scores([a, b, c], {a.url: 4}, {b.url: 6}, 6, w)
    assert s == pytest.approx({a.url: 4 + 0.5 * 2 - 0.5 * 6, b.url: 0.8 * 6 - 0.5 * 6})
    assert c.url not in s  # the floor: what any replica gets from elsewhere
    # on the GPU beats the same prefix on the host's node
    s = tier_scores([a, b], {a.url: 6}, {b.url: 6}, 6, w)
    assert s[a.url] > s[b.url]
    # a longer prefix on the host beats a short one on the GPU
    s = tier_scores([a, b], {a.url: 2}, {b.url: 10}, 10, w)
    assert s[b.url] > s[a.url]


def test_status_renders_the_gpu_view() -> None:
    from pegaflow.router.status import render_router

    view = GpuView(capacity=10, stale_s=2.0)
    rep = {**Replica("http://a:1", healthy=True).status(), "gpu_view": view.status()}
    text = render_router({"url": "http://r:1", "router": {"mode": "cache"}, "replicas": [rep]})
    assert "GPU cache from KV events: 0 blocks, NOT USED" in text and "hashes pending" in text


def test_a_holder_loses_a_request_only_where_its_queue_costs_more_than_it_saves() -> None:
    from pegaflow.router.policy import Picker

    a, b = Replica("http://a:1", healthy=True), Replica("http://b:1", healthy=True)
    p = Picker([a, b])
    a.queued_blocks = 9.0  # another request's prefill, not answered yet
    c = p.by_affinity({a.url: 10.0})
    assert (c.replica, c.decision, c.blocks) == (a, "affinity", 10.0)
    a.queued_blocks = 11.0
    assert (p.by_affinity({a.url: 10.0}).replica, p.by_affinity({a.url: 10.0}).decision) == (
        b,
        "balanced",
    )
    assert p.by_affinity({a.url: 10.0, b.url: 1.0}).replica == b  # 11 - 10 > 0 - 1
    assert Picker([a, b], queue_weight=0).by_affinity({a.url: 10.0}).replica == a  # off
    b.queued_blocks = 4.0  # no holder: the shorter queue
    assert (p.by_affinity({}).replica, p.by_affinity({}).decision) == (b, "miss")
    a.queued_blocks = b.queued_blocks = 0.0
    a.inflight, b.inflight = 3, 1  # load_blocks prices each request in flight
    assert Picker([a, b], load_blocks=4).by_affinity({a.url: 10.0, b.url: 1.0}).replica == a
    assert Picker([a, b], load_blocks=4).by_affinity({a.url: 8.0}).decision == "affinity"
    assert Picker([a, b], load_blocks=5).by_affinity({a.url: 8.0}).decision == "balanced"


def test_a_failed_health_check_clears_the_view() -> None:
    from pegaflow.router.backends import Backends
    from pegaflow.router.metrics import RouterMetrics

    from pegaflow.config import RouterConfig

    rep = Replica("http://a:1", healthy=True)
    backends = Backends(RouterConfig(mode="cache"), [rep], RouterMetrics("cache"))
    view = backends.views[rep.url] = GpuView(capacity=10, stale_s=2.0)
    view.apply(decode_batch(encode(batch(stored(tokens(2))))))
    view.next_seq = 1
    with backends.busy(rep):
        assert view.pending()  # a request in flight: events may be on their way
    backends._set_health(rep, False, "/health: refused")  # it may be restarting
    assert len(view) == 0 and view.next_seq is None
