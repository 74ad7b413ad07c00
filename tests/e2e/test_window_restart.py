"""End to end: a model mixing sliding-window and full attention layers, under vLLM's
hybrid KV cache manager (issue 39, part 1).

The connector declares ``SupportsHMA``, so vLLM (0.32, on the CPU too) keeps its hybrid
KV cache manager on for a model whose layers mix sliding-window and full attention
(gpt-oss, Gemma 3): one KV cache group per kind of layer, each with its own blocks.  A
tiny Llama whose ``layer_types`` alternate sliding (window 64) and full attention, dummy
weights, against one real ``pegaflow-server``: a cold engine computes and saves every
full-attention block and the window group's blocks of the window before the prompt's
end (two blocks, not twelve); a restarted one (a new process) must hit every full block, give the
cold outputs and hold in its KV cache, in each group, the bytes the cold engine
computed (the KV oracle, per group: the window group holds only the window's blocks).
The per-group bookkeeping in detail (null blocks, failed loads, reused window blocks):
``tests/unit/test_connector_hybrid.py``.

Slow (two engine starts): ``pytest -m slow tests/e2e/test_window_restart.py``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pegaflow.tools.devcluster import Proc
from tests.support.vllm_engine import TINY_MODEL, VllmEngine, oracle_engine, prompts
from tests.support.vllm_engine import connector_stats as stats
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

BLOCK = 32
WINDOW = 64
LENGTH = 400  # 384 tokens in 12 full blocks, six windows long
P = prompts(2, LENGTH, seed=57)


def engine(server: Proc, model: str, stats_path: str, name: str) -> VllmEngine:
    """An engine of the windowed tiny Llama with the connector on ``server``."""
    return oracle_engine(server.ready, {"model": model, "block_size": BLOCK}, stats_path, name)


def test_a_restarted_engine_loads_windowed_and_full_layers_byte_exact(
    server: Proc, tmp_path: Path
) -> None:
    """``server``: the module's ``pegaflow-server`` (``tests/conftest.py``)."""
    model = tmp_path / "tiny-window"
    model.mkdir()
    config = json.loads((Path(TINY_MODEL) / "config.json").read_text())
    config |= {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
    (model / "config.json").write_text(json.dumps(config))
    blocks = LENGTH // BLOCK
    s_cold, s_warm = (str(tmp_path / k) for k in ("cold", "warm"))

    cold = engine(server, str(model), s_cold, "cold-window")
    try:
        line = next((x for x in cold.log if "PegaFlow: " in x and " support: " in x), "")
        assert "PegaFlow: partial support: hybrid attention under vLLM's hybrid KV cache " \
            "manager (2 KV cache groups: SlidingWindowSpec, FullAttentionSpec)" in line, line
        r = cold.generate(P, 8)
        assert r["cached"] == [0, 0]
        want_kv = [cold.kv_group_digests(p) for p in P]  # per group, per block
        assert all(len(g) == blocks for ds in want_kv for g in ds)
        assert all(d is not None for ds in want_kv for d in ds[1])  # full attention
        # every full-attention block, the window group's only before the prompt's end
        saved = 2 * (blocks + WINDOW // BLOCK)
        wait_for(lambda: stats(s_cold).get("save_blocks", 0) >= saved, "cold saves", 120)
        assert stats(s_cold)["save_blocks"] == saved
    finally:
        cold.stop()

    warm = engine(server, str(model), s_warm, "warm-window")
    try:
        w = warm.generate(P, 8)
        assert w["outputs"] == r["outputs"]
        assert w["cached"] == [blocks * BLOCK] * 2  # every full block from the cluster
        # byte-exact: every block the restarted engine holds, of either group (vLLM gives
        # the window group's blocks before the window its null block: none loaded there)
        got = [warm.kv_group_digests(p) for p in P]
        for want_p, got_p in zip(want_kv, got, strict=True):
            window, full_attention = got_p
            assert None not in full_attention and None not in window[-(WINDOW // BLOCK) :]
            for want_g, got_g in zip(want_p, got_p, strict=True):
                assert [d for d in got_g if d is not None] == [
                    w for w, d in zip(want_g, got_g, strict=True) if d is not None
                ]
        wait_for(lambda: stats(s_warm).get("load_blocks", 0) >= saved, "warm loads", 120)
        assert stats(s_warm).get("load_failed_blocks", 0) == 0
    finally:
        warm.stop()
