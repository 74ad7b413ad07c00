"""End to end: a model mixing linear-attention (Gated DeltaNet, a Mamba-style recurrent
state) and full attention layers, under vLLM's hybrid KV cache manager (issue 39, part 1).

vLLM 0.32 (on the CPU too) keeps such a model's state at block boundaries when prefix
caching is on (``mamba_cache_mode`` ``align``): where a prompt's last full step ends,
and every ``--prefix-cache-retention-interval`` tokens; it names each kept state's block
to the connector, which stores it under that block's key of its group and loads it into
the block vLLM gives a hit's last position.  A tiny Qwen3-Next (three linear-attention
layers to one of full attention, dummy weights, states kept every 512 tokens) against one
real ``pegaflow-server``: a cold engine computes and saves every full-attention block
and the states vLLM kept; a restarted one (a new process) must hit up to the last kept
state of each prompt, and, for a new prompt sharing 900 tokens of one, up to the last
state before them (512 tokens), give the cold outputs and hold, in every group, the
bytes the cold engine computed (the KV oracle: a state group's block is its state
tensors' rows).

Slow (two engine starts): ``pytest -m slow tests/e2e/test_state_restart.py``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pegaflow.tools.devcluster import Proc
from scripts._models import FAMILIES
from tests.support.vllm_engine import VllmEngine, oracle_engine, prompts
from tests.support.vllm_engine import connector_stats as stats
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

BLOCK = 256  # vLLM's own choice for this model: its attention page holds a state
LENGTH = 1100  # 4 full blocks; vLLM computes 512 tokens a step, keeping states at 512, 1024
P = prompts(2, LENGTH, seed=61, vocab=1000)
SHARED = P[0][:900] + prompts(1, 200, seed=62)[0]  # new after 900 tokens (3.5 blocks)


def engine(server: Proc, model: str, stats_path: str, name: str) -> VllmEngine:
    """An engine of the tiny Qwen3-Next with the connector on ``server``, states kept
    every 512 tokens."""
    spec = {"model": model, "block_size": BLOCK, "max_num_batched_tokens": 512,
            "retention_interval": 512}  # fmt: skip
    return oracle_engine(server.ready, spec, stats_path, name)


def test_a_restarted_engine_loads_linear_attention_states_byte_exact(
    server: Proc, tmp_path: Path
) -> None:
    """``server``: the module's ``pegaflow-server`` (``tests/conftest.py``)."""
    model = tmp_path / "tiny-qwen3-next"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(FAMILIES["qwen3-next"].model("cpu")))
    blocks = LENGTH // BLOCK
    s_cold, s_warm = (str(tmp_path / k) for k in ("cold", "warm"))

    cold = engine(server, str(model), s_cold, "cold-states")
    try:
        line = next((x for x in cold.log if "PegaFlow: " in x and " support: " in x), "")
        assert "PegaFlow: partial support: hybrid attention" in line, line
        assert "Mamba / linear-attention groups" in line, line
        r = cold.generate(P, 8)
        assert r["cached"] == [0, 0]
        want_kv = [cold.kv_group_digests(p) for p in P]  # per group, per block
        for ds in want_kv:
            *states, full_attention = ds
            assert None not in full_attention and len(full_attention) == blocks
            # vLLM keeps the states after 512 (the interval) and 1024 tokens (the prompt's
            # last full step), and none between
            assert all([d is not None for d in g] == [False, True, False, True] for g in states)
        saved = 2 * (blocks + 3 * 2)  # every full-attention block, two states per group
        wait_for(lambda: stats(s_cold).get("save_blocks", 0) >= saved, "cold saves", 120)
        assert stats(s_cold).get("save_failed_blocks", 0) == 0
    finally:
        cold.stop()

    warm = engine(server, str(model), s_warm, "warm-states")
    try:
        # first (nothing in vLLM's own cache yet): no state after its 768 shared tokens,
        # the hit ends at the kept state before them
        shared = warm.generate([SHARED], 8)
        assert shared["cached"] == [2 * BLOCK]
        got_shared = warm.kv_group_digests(SHARED)
        for want_g, got_g in zip(want_kv[0], got_shared, strict=True):
            assert got_g[1] is not None and got_g[1] == want_g[1]  # loaded, byte-exact
        w = warm.generate(P, 8)
        assert w["outputs"] == r["outputs"]
        assert w["cached"] == [blocks * BLOCK] * 2  # up to the last state kept
        got = [warm.kv_group_digests(p) for p in P]
        for want_p, got_p in zip(want_kv, got, strict=True):
            *states, full_attention = got_p
            assert None not in full_attention
            assert all(g[blocks - 1] is not None for g in states)  # the hit's state, loaded
            for want_g, got_g in zip(want_p, got_p, strict=True):
                assert [d for d in got_g if d is not None] == [
                    w for w, d in zip(want_g, got_g, strict=True) if d is not None
                ]
        # the shared prompt's 2 + 3; P[0] then finds those in vLLM's own cache: 2 + 3 more
        loaded = (2 + 3) + (2 + 3) + (blocks + 3)
        wait_for(lambda: stats(s_warm).get("load_blocks", 0) >= loaded, "loads", 120)
        assert stats(s_warm).get("load_failed_blocks", 0) == 0
    finally:
        warm.stop()
