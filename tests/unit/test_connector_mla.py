"""MLA stored once (issue 39): at TP=2 every rank holds the same latent KV, so TP rank 0
alone stores one copy per block, every rank loads it, and engines of any TP share it.

The connector's real worker and scheduler objects, on the in-memory fake cluster; the
MLA cache is vLLM's ``(blocks, tokens, 576)`` per layer (DeepSeek's 512 latent + 64
rope dims, one "head")."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from pegaflow.connector.media.poolfile import PoolFileMedium
from pegaflow.connector.metadata import LoadJob, SaveJob, StepPlan
from pegaflow.connector.metrics import Counters
from pegaflow.connector.namespace import ShardLayout
from pegaflow.connector.settings import ConnectorSettings
from pegaflow.connector.worker.side import WorkerSide

from pegaflow.protocol.codec import LocatedBlocks
from tests.support.connector_fakes import (
    NB,
    NS,
    FakeCluster,
    FakeRequest,
    finish_loads,
    h,
    kv_cache_config,
    vllm_config,
)
from tests.support.waiting import wait_for

TOKENS = 4
LATENT = 576
TP2 = ShardLayout(tp_size=2, pp_size=1, replicated=True)


def mla_kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(NB, TOKENS, LATENT, generator=g).to(
            torch.bfloat16
        )
        for i in range(3)
    }


def tp2_workers(
    cluster: FakeCluster, caches: list[dict[str, torch.Tensor]]
) -> list[tuple[WorkerSide, Counters]]:
    """The two workers of a TP=2 MLA engine, ranked as the facade ranks them."""
    s = ConnectorSettings.load({}, env={})
    out = []
    for tp_rank, cache in enumerate(caches):
        c = Counters()
        shard, saves = TP2.shard(tp_rank, 0), TP2.saves(tp_rank)
        w = WorkerSide(s, shard, c, lambda: cluster, saves=saves)
        w.register_kv_caches(cache, NB)
        out.append((w, c))
    return out


def test_tp2_mla_stores_one_copy_and_every_rank_loads_it_byte_exact() -> None:
    cluster = FakeCluster()
    src = mla_kv(1)
    (w0, c0), (w1, c1) = tp2_workers(cluster, [src, {k: v.clone() for k, v in src.items()}])
    hashes = [h(i) for i in range(4)]
    for w in (w0, w1):  # every rank gets the same plan
        w.submit_saves(StepPlan(NS, saves=[SaveJob("s", [2, 3, 4, 5], hashes)]))
    wait_for(lambda: c0.totals().get("save_blocks", 0) == 4)
    w1.wait_for_copies(["s"])
    assert sorted(k[2] for k in cluster.blocks) == [0] * 4  # one shard, one copy each
    one_rank = 3 * TOKENS * LATENT * 2
    assert w0.io is not None and w0.io.block_bytes == one_rank
    assert {len(v[1]) for v in cluster.blocks.values()} == {one_rank}
    assert c0.totals()["save_bytes"] == 4 * one_rank
    assert not {k: v for k, v in c1.totals().items() if k.startswith("save_")}
    assert w1.pending_saves() == 0

    dsts = [{k: torch.zeros_like(v) for k, v in src.items()} for _ in range(2)]
    loaders = tp2_workers(cluster, dsts)
    job = LoadJob("r", [8, 9, 10, 11], hashes, [["n1"]] * 4)
    for w, _ in loaders:
        w.start_step(StepPlan(NS, loads=[job]))
    for (w, c), dst in zip(loaders, dsts, strict=True):
        errors, _ = finish_loads(w, "r")
        assert errors == set() and c.totals()["load_blocks"] == 4
        for name in src:
            assert torch.equal(dst[name][8:12], src[name][2:6])
            assert not dst[name][:8].any() and not dst[name][12:].any()
    for w, _ in [(w0, c0), (w1, c1), *loaders]:
        w.shutdown()


def test_a_rank_that_does_not_save_counts_no_drop() -> None:
    """Rank 1's saves are rank 0's: even where rank 0 would drop them (the connector
    inert here: no namespace), rank 1 counts nothing."""
    cluster = FakeCluster()
    (w0, c0), (w1, c1) = tp2_workers(cluster, [mla_kv(2), mla_kv(2)])
    for w in (w0, w1):
        w.submit_saves(StepPlan("", saves=[SaveJob("s", [1], [h(1)])]))
    assert c0.totals()["save_dropped_blocks"] == 1
    assert "save_dropped_blocks" not in c1.totals()
    w0.shutdown()
    w1.shutdown()


def test_only_the_saving_rank_takes_over_the_schedulers_pins() -> None:
    """The scheduler pins each located shard once; the rank that releases that pin is the
    one that saves, the others of the shard locate (and pin) the blocks themselves."""
    where = LocatedBlocks.build([(0, 8, 0, 0, None)])
    job = LoadJob("r", [1], [h(1)], [["n1"]], located=[where], pins=[7])
    job.located_at = time.monotonic()
    takes, locates = (
        PoolFileMedium(None, None, 0, takes_pins=t)  # type: ignore[arg-type]
        for t in (True, False)
    )
    assert takes._located(job) == ([7], where)
    assert locates._located(job) is None


# ---- the scheduler side, through the facade ----------------------------------------


class MLAAttentionSpec(SimpleNamespace):
    """vLLM's spec of an MLA layer, as the connector reads it (by its name)."""


def mla_cache_config() -> Any:
    spec = MLAAttentionSpec(
        block_size=32, num_kv_heads=1, head_size=LATENT, dtype="torch.bfloat16",
        page_size_bytes=32 * LATENT * 2,
    )  # fmt: skip
    return SimpleNamespace(
        num_blocks=64,
        kv_cache_layout="NHD",
        kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=spec)],
    )


@pytest.fixture()
def facade() -> Any:
    """``facade(cluster, tp, mla, dummy=False)``: the scheduler-side connector of such an
    engine (weights from files, else dummy ones)."""
    pytest.importorskip("vllm")
    from pegaflow.connector import PegaKVConnector
    from pegaflow.connector.compat import KVConnectorRole
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(get_hash_fn_by_name("sha256"))
    made: list[Any] = []

    def build(cluster: FakeCluster, tp: int, mla: bool, dummy: bool = False) -> Any:
        cfg = vllm_config({"cost_model": False})
        cfg.parallel_config.tensor_parallel_size = tp
        cfg.load_config.load_format = "dummy" if dummy else "auto"
        kvc = mla_cache_config() if mla else kv_cache_config()
        with mock.patch.object(PegaKVConnector, "_make_client", lambda self: cluster):
            c = PegaKVConnector(cfg, KVConnectorRole.SCHEDULER, kvc)
        c._scheduler._client_factory = lambda: cluster
        made.append(c)
        return c

    yield build
    for c in made:
        c.shutdown()


def test_a_tp2_mla_engine_hits_what_a_tp1_mla_engine_stored(facade: Any) -> None:
    cluster = FakeCluster()
    tp1, tp2 = facade(cluster, 1, True), facade(cluster, 2, True)
    ns = tp1._scheduler.namespace
    assert ns and tp2._scheduler.namespace == ns
    assert tp2._scheduler.world_size == 1
    req = FakeRequest("r", list(range(100)), 32)
    for bh in req.block_hashes:
        cluster.blocks[(ns, bh, 0)] = ("n1", b"x")  # what TP=1's one rank stored
    assert tp2.get_num_new_matched_tokens(req, 0)[0] == 96


def test_mla_engines_of_dummy_weights_share_only_at_one_tp_size(facade: Any) -> None:
    """Dummy weights are drawn per rank's slice: at another TP size another model."""
    cluster = FakeCluster()
    ns = [facade(cluster, tp, True, dummy=True)._scheduler.namespace for tp in (1, 2, 2)]
    assert ns[0] != ns[1] == ns[2]


def test_dense_engines_of_other_tp_sizes_still_never_share(facade: Any) -> None:
    cluster = FakeCluster()
    tp1, tp2 = facade(cluster, 1, False), facade(cluster, 2, False)
    ns1, ns2 = tp1._scheduler.namespace, tp2._scheduler.namespace
    assert ns1 and ns2 and ns1 != ns2
    assert tp2._scheduler.world_size == 2
    req = FakeRequest("r", list(range(100)), 32)
    for bh in req.block_hashes:
        cluster.blocks[(ns2, bh, 0)] = ("n1", b"x")  # rank 0's shard only
    assert tp2.get_num_new_matched_tokens(req, 0) == (0, False)
