"""Fakes for the connector's unit tests: requests, scheduler outputs, an in-memory cluster."""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from pegaflow.client.nodehealth import NodeHealth
from pegaflow.connector.metadata import SaveJob, StepPlan
from pegaflow.connector.metrics import Counters
from pegaflow.connector.scheduler.side import SchedulerSide
from pegaflow.connector.settings import ConnectorSettings
from pegaflow.connector.worker.side import WorkerSide

from pegaflow.deadline import Deadline
from pegaflow.errors import DeadlineExceeded, Unavailable
from pegaflow.protocol.codec import LocatedBlocks
from tests.support.waiting import wait_for


def chain_hashes(tokens: list[int], block_size: int, seed: bytes = b"root") -> list[bytes]:
    """vLLM-style chained block hashes of the full blocks of ``tokens``."""
    out: list[bytes] = []
    parent = hashlib.sha256(seed).digest()
    for i in range(len(tokens) // block_size):
        blk = tokens[i * block_size : (i + 1) * block_size]
        parent = hashlib.sha256(parent + repr(blk).encode()).digest()
        out.append(parent)
    return out


class FakeRequest:
    """The attributes of ``vllm.v1.request.Request`` the connector reads."""

    def __init__(
        self, request_id: str, tokens: list[int], block_size: int, output: int = 0
    ) -> None:
        self.request_id = request_id
        self.prompt = list(tokens)
        self.num_prompt_tokens = len(tokens)
        self.all_tokens = list(tokens) + [7] * output
        self.block_size = block_size

    @property
    def num_tokens(self) -> int:
        return len(self.all_tokens)

    @property
    def block_hashes(self) -> list[bytes]:
        return chain_hashes(self.all_tokens, self.block_size)

    def append(self, n: int) -> None:
        """Generate ``n`` more tokens."""
        self.all_tokens += [9] * n


def new_req(req_id: str, block_ids: list[int], num_computed: int) -> Any:
    return SimpleNamespace(
        req_id=req_id, block_ids=(list(block_ids),), num_computed_tokens=num_computed
    )


def sched_output(
    new: list[Any] | None = None,
    cached: list[tuple[str, list[int] | None, int]] | None = None,
    scheduled: dict[str, int] | None = None,
    finished: set[str] | None = None,
    preempted: set[str] | None = None,
    resumed: set[str] | None = None,
) -> Any:
    """A ``SchedulerOutput`` look-alike; ``cached``: (req id, new block ids, computed)."""
    cached = cached or []
    return SimpleNamespace(
        scheduled_new_reqs=new or [],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            resumed_req_ids=resumed or set(),
            new_block_ids=[(c[1],) if c[1] is not None else None for c in cached],
            num_computed_tokens=[c[2] for c in cached],
        ),
        num_scheduled_tokens=scheduled or {},
        scheduled_spec_decode_tokens={},
        finished_req_ids=finished or set(),
        preempted_req_ids=preempted or set(),
    )


@dataclass
class FakeLookup:
    hits: int
    blocks: list[list[str]] = field(default_factory=list)
    nodes: dict[str, Any] = field(default_factory=dict)
    generations: list[list[int]] = field(default_factory=list)


@dataclass
class FakePut:
    stored: int = 0
    skipped: int = 0
    failed: int = 0


class FakeCluster:
    """In-memory cluster with the SyncPegaClient surface and failure switches."""

    def __init__(self, node: str = "n1") -> None:
        self.node = node
        self.health = NodeHealth()
        """as ``SyncPegaClient.health``: the nodes its gets found down"""
        self.blocks: dict[tuple[str, bytes, int], tuple[str, bytes]] = {}
        self.lookup_error: Exception | None = None
        self.dead_nodes: set[str] = set()
        self.corrupt: set[bytes] = set()
        self.put_error: Exception | None = None
        self.lookups = 0
        self.locate_error: Exception | None = None
        self.connect_gate: threading.Event | None = None
        self.gets = 0
        self.puts = 0
        self.lock = threading.Lock()
        self.put_gate: threading.Event | None = None
        self.pins: list[tuple[str, list[Any], float]] = []
        self.gens: dict[tuple[str, bytes, int], int] = {}
        """generation of each block (bumped when a test re-stores it: see restore)"""
        self.locates: list[tuple[str, list[Any], float]] = []
        self.unlocatable: set[bytes] = set()
        """blocks ``locate`` does not find (evicted between lookup and locate)"""
        self.transfers_opened = False

    def open_transfers(self, timeout: float | None = None) -> None:
        self.transfers_opened = True

    def restore(self, ns: str, h: bytes, shard: int = 0) -> None:
        """The block was evicted and stored again: same bytes, a new generation."""
        key = (ns, h, shard)
        self.gens[key] = self.gens.get(key, 0) + 1

    # lookup ---------------------------------------------------------------------------
    def lookup(
        self,
        ns: str,
        hashes: Any,
        shards: Any = (0,),
        timeout: float | None = None,
        generations: bool = False,
        warm_up: bool = False,
    ) -> FakeLookup:
        self._connect(timeout)
        self.lookups += 1
        if self.lookup_error is not None:
            raise self.lookup_error
        blocks: list[list[str]] = []
        gens: list[list[int]] = []
        for h in hashes:
            row = []
            for s in shards:
                loc = self.blocks.get((ns, h, s))
                if loc is None:
                    break
                row.append(loc[0])
            if len(row) != len(list(shards)):
                break
            blocks.append(row)
            gens.append([self.gens.get((ns, h, s), 0) for s in shards])
        return FakeLookup(len(blocks), blocks, generations=gens if generations else [])

    # data -----------------------------------------------------------------------------
    def get_blocks(
        self,
        ns: str,
        items: Any,
        timeout: float | None = None,
        generations: Any = None,
        *,
        zero_copy: bool = False,
    ) -> list[bool]:
        self.gets += 1
        ok = []
        for i, (node, h, shard, buf) in enumerate(items):
            loc = self.blocks.get((ns, h, shard))
            want = None if generations is None else generations[i]
            if want is not None and self.gens.get((ns, h, shard), 0) != want:
                ok.append(False)  # fenced: the slot holds another generation now
                continue
            arr = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
            if loc is None or node in self.dead_nodes or loc[0] != node or len(loc[1]) != arr.size:
                ok.append(False)
                continue
            if h in self.corrupt:  # checksum mismatch: the client reports False
                ok.append(False)
                continue
            np.frombuffer(buf, dtype=np.uint8)[:] = np.frombuffer(loc[1], dtype=np.uint8)
            ok.append(True)
        return ok

    def put_blocks(
        self, ns: str, items: Any, node_id: str | None = None, timeout: float | None = None
    ) -> FakePut:
        if self.put_gate is not None:
            self.put_gate.wait(10)
        self.puts += 1
        if self.put_error is not None:
            raise self.put_error
        res = FakePut()
        with self.lock:
            for h, shard, buf in items:
                key = (ns, h, shard)
                if key in self.blocks:
                    res.skipped += 1
                    continue
                self.blocks[key] = (node_id or self.node, bytes(memoryview(buf).cast("B")))
                res.stored += 1
        return res

    def submit_pin_blocks(
        self, ns: str, items: Any, ttl_s: float = 5.0
    ) -> concurrent.futures.Future[list[bool]]:
        self.pins.append((ns, list(items), ttl_s))
        f: concurrent.futures.Future[list[bool]] = concurrent.futures.Future()
        f.set_result([(ns, h, s) in self.blocks for _n, h, s in items])
        return f

    def submit_get_blocks(
        self,
        ns: str,
        items: Any,
        timeout: float | None = None,
        generations: Any = None,
        *,
        zero_copy: bool = False,
    ) -> concurrent.futures.Future[list[bool]]:
        f: concurrent.futures.Future[list[bool]] = concurrent.futures.Future()
        try:
            f.set_result(self.get_blocks(ns, items, timeout, generations))
        except Exception as e:
            f.set_exception(e)
        return f

    def settled(self, buf: Any) -> bool:
        """Fake gets complete before they return: nothing writes a buffer afterwards."""
        return True

    def submit_put_blocks(
        self, ns: str, items: Any, node_id: str | None = None, timeout: float | None = None
    ) -> concurrent.futures.Future[FakePut]:
        f: concurrent.futures.Future[FakePut] = concurrent.futures.Future()
        # copy the buffers now (the real client sends them before the future resolves)
        frozen = [(h, s, bytes(memoryview(b).cast("B"))) for h, s, b in items]

        def run() -> None:
            try:
                f.set_result(self.put_blocks(ns, frozen, node_id, timeout))
            except Exception as e:
                f.set_exception(e)

        threading.Thread(target=run, daemon=True).start()
        return f

    def _connect(self, timeout: Any) -> None:
        """Wait for ``connect_gate``, when one is set (the first calls' connections)."""
        gate = self.connect_gate
        if gate is not None and not gate.wait(Deadline.of(timeout, 5.0).remaining()):
            raise DeadlineExceeded("connect gate")

    # same host ------------------------------------------------------------------------
    def locate(
        self,
        ns: str,
        node: str,
        hashes: Any,
        shard: int = 0,
        ttl_s: float = 5.0,
        timeout: Any = None,
    ) -> tuple[int, LocatedBlocks]:
        """Where the blocks of ``node`` are in its pool (``SyncPegaClient.locate``)."""
        self._connect(timeout)
        self.locates.append((node, [(h, shard) for h in hashes], ttl_s))
        if self.locate_error is not None:
            raise self.locate_error
        rows: list[Any] = []
        for k, h in enumerate(hashes):
            loc = self.blocks.get((ns, h, shard))
            if loc is None or loc[0] != node or h in self.unlocatable:
                rows.append(None)
                continue
            gen = self.gens.get((ns, h, shard), 0)
            rows.append((k * len(loc[1]), len(loc[1]), gen, 0, None))
        return len(self.locates), LocatedBlocks.build(rows)

    def lookup_here(self, *args: Any, **kwargs: Any) -> FakeLookup:
        """``SyncPegaClient.lookup_here``: :meth:`lookup`."""
        return self.lookup(*args, **kwargs)

    def locate_here(self, *args: Any, **kwargs: Any) -> tuple[int, LocatedBlocks]:
        """``SyncPegaClient.locate_here``: :meth:`locate`."""
        return self.locate(*args, **kwargs)

    def report_lookups(
        self, node: str, lookups: int, asked: int, hits: int, timeout: Any = None
    ) -> None:
        """``SyncPegaClient.report_lookups``: the fake keeps no node counters."""

    def submit_unpin(
        self, node: str, pin: int, timeout: Any = None
    ) -> concurrent.futures.Future[None]:
        """Pins of the fake expire by themselves: an unpin has nothing to do."""
        return _done(lambda: None)

    def close(self) -> None:
        pass


def _done(fn: Any, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
    """A future of ``fn(*args, **kwargs)``, run now (as the fakes' ``submit_*``)."""
    f: concurrent.futures.Future[Any] = concurrent.futures.Future()
    try:
        f.set_result(fn(*args, **kwargs))
    except Exception as e:
        f.set_exception(e)
    return f


DEADLINE = DeadlineExceeded("lookup deadline")
DOWN = Unavailable("cluster down")


class Clock:
    """A clock that stands still until a test moves ``t``."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


BS = 4


NS = "tiny.abc"


def make(
    cluster: FakeCluster | None = None,
    world: int = 1,
    clock: Clock | None = None,
    **settings: object,
) -> tuple[SchedulerSide, FakeCluster, Counters]:
    cluster = cluster or FakeCluster()
    # the bookkeeping tests claim every hit; the cost model has tests of its own
    s = ConnectorSettings.load({"cost_model": False, **settings}, env={})
    c = Counters()
    side = SchedulerSide(
        s, BS, world, namespace=lambda: NS, counters=c, client=cluster, clock=clock or Clock()
    )
    return side, cluster, c


def store(cluster: FakeCluster, req: FakeRequest, n: int, world: int = 1, node: str = "n1") -> None:
    for h in req.block_hashes[:n]:
        for s in range(world):
            cluster.blocks[(NS, h, s)] = (node, b"x")


def toks(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def costed(cluster: FakeCluster, **settings: object) -> tuple[SchedulerSide, Counters]:
    """A scheduler side with the cost model on, for a GPU engine with 2 MiB blocks of
    4 tokens (before any measurement: prefill at 5 GB/s of KV, TCP loads at 1 GB/s)."""
    s = ConnectorSettings.load(settings, env={})
    c = Counters()
    side = SchedulerSide(
        s, BS, 1, namespace=lambda: NS, counters=c, client=cluster, clock=Clock(),
        device="cuda", block_bytes=2 << 20,
    )  # fmt: skip
    return side, c


NB = 16


def kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(NB, 2, 8, 16, generator=g).to(
            torch.bfloat16
        )
        for i in range(3)
    }


def worker(
    cluster: FakeCluster, caches: dict[str, torch.Tensor], **settings: object
) -> tuple[WorkerSide, Counters]:
    s = ConnectorSettings.load({"chunk_bytes": 2 * 3 * 512, **settings}, env={})  # 2 blocks/chunk
    c = Counters()
    w = WorkerSide(s, 0, c, lambda: cluster)
    w.register_kv_caches(caches, NB)
    return w, c


def h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def finish_loads(w: WorkerSide, req: str) -> tuple[set[int], set[str] | None]:
    """Step until ``req`` is reported loaded; returns (errors reported, sending)."""
    errors: set[int] = set()
    deadline = time.monotonic() + 60
    while True:
        sending, recving = w.get_finished(set())
        errors |= w.take_load_errors()
        if recving and req in recving:
            return errors, sending
        assert time.monotonic() < deadline
        time.sleep(0.01)


def save(w: WorkerSide, cluster: FakeCluster, blocks: list[int], hashes: list[bytes]) -> None:
    w.submit_saves(StepPlan(NS, saves=[SaveJob("s", blocks, hashes)]))
    wait_for(lambda: sum(1 for k in cluster.blocks if k[0] == NS) >= len(hashes))


def vllm_config(extra: dict[str, Any] | None = None, policy: str = "recompute") -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector="PegaKVConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra or {},
            kv_load_failure_policy=policy,
            is_kv_producer=True,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="/m/tiny", dtype="bfloat16", seed=0),
        cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256", cache_dtype="auto"),
        load_config=SimpleNamespace(load_format="dummy"),
    )


class FullAttentionSpec(SimpleNamespace):
    """vLLM's spec of a full-attention layer, as the connector reads it (by its name)."""


def kv_cache_config(groups: int = 1, block_size: int = 32) -> Any:
    """vLLM's KV cache config of ``groups`` groups of two layers (the facade tests' block
    size, 32 tokens)."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=32, dtype="torch.bfloat16",
        page_size_bytes=8192,
    )
    return SimpleNamespace(
        num_blocks=64,
        kv_cache_layout="LBHNC",
        kv_cache_groups=[
            SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=spec) for _ in range(groups)
        ],
    )
