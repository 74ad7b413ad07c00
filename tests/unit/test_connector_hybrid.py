"""The connector under vLLM's hybrid KV cache manager, against vLLM's own scheduler.

These tests build vLLM's real ``Scheduler`` (its ``KVCacheManager``, its per-group block
tables and null blocks, its ``request_finished_all_groups`` call) with a full-attention
group beside a sliding-window group (or a Mamba group), the connector inside it wired to
an in-memory cluster, and check what the connector plans: every group's blocks saved
under keys of their own, a hit claimed only where every group has its blocks, loads
into exactly the blocks vLLM allocated (none into the window's skipped start), a step
that reuses a window block whose save may still be copying waits for that copy, and a
Mamba group's states saved where vLLM names them and loaded into a hit's last block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("vllm")

import torch
from pegaflow.connector import PegaKVConnector
from pegaflow.connector.compat import PegaConnectorMetadata
from pegaflow.connector.metadata import StepPlan
from pegaflow.connector.namespace import group_keys
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.support.connector_fakes import FakeCluster
from tests.support.vllm_engine import TINY_MODEL

BS = 16
WINDOW = 64
"""the sliding window: a hit at ``L`` needs the window group's blocks of
``[L - WINDOW + 1, L)``, ``cdiv(WINDOW - 1, BS)`` = 4 blocks"""
FA = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
SW = SlidingWindowSpec(
    block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=WINDOW
)


@pytest.fixture(scope="module")
def config() -> Any:
    """An engine config with the connector (the tiny model's), hybrid manager on."""
    args = EngineArgs(
        model=TINY_MODEL, skip_tokenizer_init=True, load_format="dummy", block_size=BS,
        enable_prefix_caching=True, max_model_len=1024, max_num_batched_tokens=1024,
        kv_transfer_config=KVTransferConfig(
            kv_connector="PegaKVConnector", kv_connector_module_path="pegaflow.connector",
            kv_role="kv_both", kv_connector_extra_config={"cost_model": False},
        ),
    )  # fmt: skip
    vc = args.create_engine_config()
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False  # as on a GPU
    return vc


def make_scheduler(
    config: Any, cluster: FakeCluster, groups: list[Any], blocks: int, anchor_tokens: int = 0
) -> Scheduler:
    """vLLM's scheduler with ``groups`` of one layer each and ``blocks`` blocks; the
    window groups stored before every ``anchor_tokens`` too (0: only where saves stop)."""
    config.cache_config.num_gpu_blocks = blocks
    extra = config.kv_transfer_config.kv_connector_extra_config
    extra["window_anchor_tokens"] = anchor_tokens
    kcc = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(groups)],
    )
    with mock.patch.object(PegaKVConnector, "_make_client", lambda self: cluster):
        s = Scheduler(config, kcc, StructuredOutputManager(config), block_size=BS)
    conn = s.connector
    assert isinstance(conn, PegaKVConnector)
    conn._make_client = lambda: cluster  # type: ignore[method-assign]
    assert conn._scheduler is not None
    conn._scheduler._client_factory = lambda: cluster
    return s


def request(rid: str, tokens: list[int], max_tokens: int = 1) -> Request:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(get_hash_fn_by_name("sha256"))
    return Request(
        rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
        block_hasher=get_request_block_hasher(BS, get_hash_fn_by_name("sha256")),
    )  # fmt: skip


def step(s: Scheduler) -> tuple[Any, StepPlan]:
    """One engine step: schedule, then every scheduled request emits one token."""
    out = s.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, PegaConnectorMetadata)
    reqs = [r for r, n in out.num_scheduled_tokens.items() if n]
    runner = ModelRunnerOutput(
        req_ids=reqs,
        req_id_to_index={r: i for i, r in enumerate(reqs)},
        sampled_token_ids=[[5] for _ in reqs],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )
    s.update_from_output(out, runner)
    return out, meta.plan


def keys_of(s: Scheduler, req: Request) -> list[bytes]:
    ns_groups = len(s.kv_cache_config.kv_cache_groups)
    return group_keys([bytes(h) for h in req.block_hashes], ns_groups)


def store_saves(cluster: FakeCluster, plan: StepPlan) -> None:
    """What the workers would have stored for ``plan``'s saves."""
    for job in plan.saves:
        for key in job.hashes:
            cluster.blocks[(plan.namespace, key, 0)] = ("n1", b"x")


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    yield FakeCluster()


def test_the_three_key_config_keeps_vllms_hybrid_manager(config: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)


def test_every_group_is_saved_and_a_restarted_engine_loads_every_group(
    config: Any, cluster: FakeCluster
) -> None:
    first = make_scheduler(config, cluster, [FA, SW], 200)
    tokens = list(range(1000, 1160))  # 10 blocks
    r1 = request("r1", tokens)
    first.add_request(r1)
    out, plan = step(first)
    assert first.connector.support.level == "partial"
    saves = [(b, k) for job in plan.saves for b, k in zip(job.block_ids, job.hashes, strict=True)]
    keys = keys_of(first, r1)
    fa_ids, sw_ids = out.scheduled_new_reqs[0].block_ids
    # the prompt's 10 full blocks of the full-attention group; of the window group only
    # the window before the end, positions 6..9 (4 blocks: cdiv(WINDOW - 1, BS)), each
    # under its group's key
    assert sorted(saves) == sorted(
        [(fa_ids[i], keys[2 * i]) for i in range(10)]
        + [(sw_ids[i], keys[2 * i + 1]) for i in range(6, 10)]
    )
    store_saves(cluster, plan)
    for _ in range(3):
        step(first)  # r1 finishes; vLLM asks the connector (all groups) about its blocks

    # a new engine (a restart: nothing in vLLM's own cache): the prompt plus 40 tokens
    second = make_scheduler(config, cluster, [FA, SW], 200)
    r2 = request("r2", tokens + list(range(2000, 2040)))
    second.add_request(r2)
    out, plan = step(second)
    assert "r2" not in out.num_scheduled_tokens  # waits for its load (asynchronous)
    assert len(plan.loads) == 1
    load = plan.loads[0]
    fa2, sw2 = second.kv_cache_manager.get_block_ids("r2")
    keys2 = keys_of(second, r2)
    skipped = (160 - WINDOW + 1) // BS  # the window group's blocks attention skips
    assert all(b == 0 for b in sw2[:skipped])  # vLLM's null block
    expect = [(fa2[i], keys2[2 * i]) for i in range(10)]
    expect += [(sw2[i], keys2[2 * i + 1]) for i in range(skipped, 10)]
    assert sorted(zip(load.block_ids, load.hashes, strict=True)) == sorted(expect)
    assert 0 not in load.block_ids


def test_a_failed_hybrid_load_reported_by_request_is_recomputed_whole(
    config: Any, cluster: FakeCluster
) -> None:
    """The worker's ``failed_recving`` (what :meth:`PegaKVConnector.get_transfer_results`
    sends for a model of several groups): vLLM's scheduler computes the prompt whole."""
    from vllm.v1.outputs import KVConnectorOutput

    first = make_scheduler(config, cluster, [FA, SW], 200)
    tokens = list(range(4000, 4160))
    first.add_request(request("f1", tokens))
    _, plan = step(first)
    store_saves(cluster, plan)
    second = make_scheduler(config, cluster, [FA, SW], 200)
    second.add_request(request("f2", tokens + [3] * 40))
    _, plan = step(second)
    assert len(plan.loads) == 1
    out = second.schedule()
    second.update_from_output(out, ModelRunnerOutput(
        req_ids=[], req_id_to_index={}, sampled_token_ids=[], logprobs=None,
        prompt_logprobs_dict={}, pooler_output=[],
        kv_connector_output=KVConnectorOutput(finished_recving={"f2"}, failed_recving={"f2"}),
    ))  # fmt: skip
    cluster.blocks.clear()  # what made the load fail: the node lost the blocks
    out, _ = step(second)
    assert out.num_scheduled_tokens["f2"] == 200  # nothing taken from the failed load


def test_a_hit_ends_where_every_group_has_its_blocks(config: Any, cluster: FakeCluster) -> None:
    """With anchors every 4 blocks the window group is stored before positions 4, 8
    and 10 (the end); its blocks of positions 8 and 9 lost, the hit ends at the anchor
    8, whose window (4..7) is there; the full-attention group alone would hit 10."""
    first = make_scheduler(config, cluster, [FA, SW], 200, anchor_tokens=4 * BS)
    tokens = list(range(3000, 3160))
    r1 = request("a1", tokens)
    first.add_request(r1)
    _, plan = step(first)
    keys = keys_of(first, r1)
    assert sum(len(j.hashes) for j in plan.saves) == 10 + 10  # windows before 4, 8, 10
    store_saves(cluster, plan)
    for i in (8, 9):
        del cluster.blocks[(plan.namespace, keys[2 * i + 1], 0)]
    second = make_scheduler(config, cluster, [FA, SW], 200, anchor_tokens=4 * BS)
    second.add_request(request("a2", tokens + [1] * 40))
    _, plan = step(second)
    assert len(plan.loads) == 1
    keys2 = keys_of(second, second.requests["a2"])
    assert sorted(plan.loads[0].hashes) == sorted(
        [keys2[2 * i] for i in range(8)] + [keys2[2 * i + 1] for i in range(4, 8)]
    )
    # without anchors nothing but the end's window is stored: no hit at all
    third = make_scheduler(config, cluster, [FA, SW], 200)
    third.add_request(request("a3", tokens + [2] * 40))
    _, plan = step(third)
    assert not plan.loads


def test_a_reused_window_block_waits_for_its_save(config: Any, cluster: FakeCluster) -> None:
    """A long prompt in chunks: its window group's early blocks are freed while it runs
    (after their saves were planned); the step that gives one of them to another
    request lists the saver, so the workers finish its copies before the forward pass."""
    config.scheduler_config.max_num_batched_tokens = 128
    try:
        s = make_scheduler(config, cluster, [FA, SW], 48)
    finally:
        config.scheduler_config.max_num_batched_tokens = 1024
    s.add_request(request("long", list(range(5000, 5000 + 480)), max_tokens=4))  # 30 blocks
    _, plan = step(s)
    assert plan.saves and not plan.preempted
    fenced = []
    for k in range(8):
        s.add_request(request(f"n{k}", list(range(7000 + 100 * k, 7000 + 100 * k + 32))))
        out, plan = step(s)
        if "long" not in (out.preempted_req_ids or ()):  # not vLLM's own preemption
            fenced += plan.preempted
    assert "long" in fenced


def test_mamba_groups_turn_the_connector_off_and_the_engine_runs(
    config: Any, cluster: FakeCluster
) -> None:
    mamba = MambaSpec(
        block_size=BS, shapes=((4, 4),), dtypes=(torch.float32,), mamba_cache_mode="none"
    )
    s = make_scheduler(config, cluster, [FA, mamba], 100)
    assert s.connector.support.level == "off"
    assert "Mamba" in s.connector.support.line()
    s.add_request(request("m", list(range(64))))
    out, plan = step(s)
    assert out.num_scheduled_tokens["m"] == 64 and not plan.saves and not plan.loads


def test_mamba_states_vllm_keeps_are_saved_and_loaded_into_the_hits_last_block(
    config: Any, cluster: FakeCluster
) -> None:
    """With prefix caching vLLM keeps a Mamba group's state where a step of its request
    ended on a block boundary (``mamba_cache_mode`` ``align``) and names its block: the
    connector stores it under that position's key of its group, and a restarted engine's
    hit ends where every state group has its state, loaded into the block vLLM gives
    that position (the positions before it: vLLM's null block, nothing loaded)."""
    mamba = MambaSpec(
        block_size=BS, shapes=((4, 4),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )
    with mock.patch.object(config.cache_config, "mamba_cache_mode", "align"):
        _states_saved_and_loaded(config, cluster, mamba)


def _states_saved_and_loaded(config: Any, cluster: FakeCluster, mamba: MambaSpec) -> None:
    first = make_scheduler(config, cluster, [mamba, FA], 200)
    assert first.connector.support.level == "partial"
    tokens = list(range(1000, 1070))  # 4 full blocks and 6 tokens
    r1 = request("r1", tokens)
    first.add_request(r1)
    saves: list[tuple[int, bytes]] = []
    for _ in range(4):
        _, plan = step(first)
        saves += [
            (b, k) for job in plan.saves for b, k in zip(job.block_ids, job.hashes, strict=True)
        ]
        store_saves(cluster, plan)
    keys = keys_of(first, r1)
    full = [k for _, k in saves if k in keys[1::2]]
    states = [(b, k) for b, k in saves if k in keys[0::2]]
    assert sorted(full) == sorted(keys[1:8:2])  # the 4 full-attention blocks
    assert [k for _, k in states] == [keys[2 * 3]]  # the state after 64 tokens
    assert states[0][0] > 0

    second = make_scheduler(config, cluster, [mamba, FA], 200)
    r2 = request("r2", tokens + list(range(2000, 2040)))
    second.add_request(r2)
    _, plan = step(second)
    assert len(plan.loads) == 1
    load = plan.loads[0]
    m2, fa2 = second.kv_cache_manager.get_block_ids("r2")
    keys2 = keys_of(second, r2)
    expect = [(fa2[i], keys2[2 * i + 1]) for i in range(4)] + [(m2[3], keys2[2 * 3])]
    assert m2[3] > 0 and all(b == 0 for b in m2[:3])
    assert sorted(zip(load.block_ids, load.hashes, strict=True)) == sorted(expect)
