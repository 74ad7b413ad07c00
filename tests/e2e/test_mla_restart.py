"""End to end: an MLA model's latent KV stored and loaded byte-exact (issue 39, part 2).

A real vLLM engine (CPU, its ``CPU_MLA`` backend) of a DeepSeek-V2-like model scaled
down (2 dense layers, hidden 128, vLLM's one MLA head size: 512 latent + 64 rope dims),
dummy weights, against one real ``pegaflow-server``.  A cold engine finds nothing and
saves; a restarted one (a new process) must load every full block, each one rank's
``(16 tokens, 576)`` tile per layer, and give the cold outputs.  At TP=2 the same, with
one copy stored (by rank 0) and loaded by both ranks.  vLLM turns its own
prefix caching off for MLA on the CPU, so the engine's KV bytes cannot be read back per
block hash here (``kv_digest``): the byte-exact check of MLA blocks, at TP=2, is
``tests/unit/test_connector_mla.py``'s.

Slow (four engine starts): ``pytest -m slow tests/e2e/test_mla_restart.py``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pegaflow.tools.devcluster import Proc
from tests.support.vllm_engine import VllmEngine, prompts
from tests.support.vllm_engine import connector_stats as stats
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

BLOCK = 16  # the CPU MLA backend's only block size (vLLM overrides any other)
LENGTH = 300  # 288 tokens in 18 full blocks
P = prompts(2, LENGTH, seed=39)
LATENT = 512 + 64
BLOCK_BYTES = 2 * BLOCK * LATENT * 2
"""one stored block: 2 layers of one rank's ``(BLOCK, LATENT)`` bf16 tile"""
CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
    "num_hidden_layers": 2, "first_k_dense_replace": 2, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
    "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_scaling": None, "vocab_size": 1024, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "attention_bias": False,
}  # fmt: skip


def engine(server: Proc, model: str, stats_path: str, name: str, tp: int = 1) -> VllmEngine:
    """An engine of the tiny MLA model; TP=1 runs in the test runner's process, TP=2 has
    its ranks pinned to a core each (a CI machine has two)."""
    ready = server.ready  # every hit claimed: the cost model is not under test here,
    # nor the deadlines (a CI machine of two cores runs a TP=2 engine's two ranks, its
    # core and the server: a lookup past the default deadline counts no hit)
    connector = dict(coordinators=ready["coordinator"], local_node=ready["node"],
                     stats_path=stats_path, transfer_timeout_s=30.0, lookup_timeout_s=5.0,
                     cost_model=False)  # fmt: skip
    spec = {"model": model, "connector": connector, "block_size": BLOCK, "tp": tp}
    one_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env = one_process if tp == 1 else {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    return VllmEngine(spec, env=env, name=name)


def test_a_restarted_mla_engine_loads_the_latent_kv_the_cold_one_computed(
    server: Proc, tmp_path: Path
) -> None:
    """``server``: the module's ``pegaflow-server`` (``tests/conftest.py``)."""
    model = tmp_path / "tiny-mla"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    blocks = LENGTH // BLOCK
    s_cold, s_warm = (str(tmp_path / k) for k in ("cold", "warm"))

    cold = engine(server, str(model), s_cold, "cold-mla")
    try:
        line = next((x for x in cold.log if "PegaFlow: " in x and " support: " in x), "")
        assert "PegaFlow: full support: MLA: the latent KV stored once" in line, cold.tail()
        assert line.endswith(f"block size {BLOCK}")
        r = cold.generate(P, 8)
        assert r["cached"] == [0, 0]
        wait_for(lambda: stats(s_cold).get("save_blocks", 0) >= 2 * blocks, "cold saves", 120)
        st = stats(s_cold)
        assert st["save_bytes"] == st["save_blocks"] * BLOCK_BYTES
    finally:
        cold.stop()

    warm = engine(server, str(model), s_warm, "warm-mla")
    try:
        w = warm.generate(P, 8)
        assert w["outputs"] == r["outputs"]
        assert w["cached"] == [blocks * BLOCK] * 2  # every full block from the cluster
        wait_for(lambda: stats(s_warm).get("load_blocks", 0) >= 2 * blocks, "warm loads", 120)
        st = stats(s_warm)
        assert st.get("load_failed_blocks", 0) == 0
        assert st["load_bytes"] == st["load_blocks"] * BLOCK_BYTES
    finally:
        warm.stop()



def test_tp2_mla_engines_store_one_copy_and_both_ranks_load_it(
    server: Proc, tmp_path: Path
) -> None:
    """At TP=2 the cold engine's rank 0 alone saves (one copy of one rank's bytes); a
    restarted TP=2 engine's two ranks both load it and give the cold outputs.  (Dummy
    weights are another model at another TP size, so these engines share nothing with
    the TP=1 ones: ``tests/unit/test_connector_mla.py`` tests the sharing.)"""
    model = tmp_path / "tiny-mla"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    blocks = LENGTH // BLOCK
    s_cold, s_warm = (str(tmp_path / k) for k in ("cold", "warm"))

    def rank(prefix: str, r: int) -> dict[str, float]:
        return json.loads(Path(f"{prefix}.worker{r}.json").read_text())

    cold = engine(server, str(model), s_cold, "cold-mla-tp2", tp=2)
    try:
        r = cold.generate(P, 8)
        assert r["cached"] == [0, 0]
        wait_for(lambda: stats(s_cold).get("save_blocks", 0) >= 2 * blocks, "cold saves", 120)
        assert rank(s_cold, 0)["save_bytes"] == 2 * blocks * BLOCK_BYTES
        assert not {k: v for k, v in rank(s_cold, 1).items() if k.startswith("save_") and v}
    finally:
        cold.stop()

    warm = engine(server, str(model), s_warm, "warm-mla-tp2", tp=2)
    try:
        w = warm.generate(P, 8)
        assert w["outputs"] == r["outputs"]
        assert w["cached"] == [blocks * BLOCK] * 2
        wait_for(lambda: stats(s_warm).get("load_blocks", 0) >= 2 * 2 * blocks, "loads", 120)
        for i in range(2):
            st = rank(s_warm, i)
            assert st["load_blocks"] == 2 * blocks and st.get("load_failed_blocks", 0) == 0
            assert st["load_bytes"] == 2 * blocks * BLOCK_BYTES
    finally:
        warm.stop()
