"""End to end: fp8 KV caches and vLLM's block sizes, stored and loaded byte-exact, each
in its own namespace (issue 39, part 3).

Real vLLM engines (CPU, the tiny dummy Llama, ``--kv-cache-dtype`` and ``--block-size``
as an operator gives them) against one real ``pegaflow-server``.  vLLM's CPU attention
takes block sizes that are multiples of 32 (16 is refused at start: "No common block
size for 16") and the KV dtypes ``auto``, ``fp8`` (on the CPU the same bytes as
``fp8_e5m2``), ``fp8_e4m3`` and ``fp8_e5m2``; fp8 pages are ``uint8`` tensors there, one
byte per element.  Per (dtype, block size) two engines start, one after the other: a
cold one, which finds nothing in the cluster (so its outputs and KV are computed
without the cache) and saves; and a restarted one (a new process), which must load
every full block, give the cold outputs, and hold in its KV cache exactly the bytes the
cold engine computed (the KV oracle: the tiny model's dummy weights give the same
tokens even from all-zero KV).  Every engine asks the cluster for the same prompts as
the pairs before it, which saved them under their own dtype or block size: a hit
across them would show in the cold engine's counters.

Slow (eight engine starts of 10-30 s each): ``pytest -m slow
tests/e2e/test_kv_dtypes_block_sizes.py``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
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

MAX_TOKENS = 8
LENGTH = 400  # 384 tokens in full blocks at every block size below
P = prompts(2, LENGTH, seed=21)
#: (kv_cache_dtype, block_size): two fp8 formats of one block size (same block hashes:
#: only the namespace keeps them apart), fp8 and bf16 at larger blocks
PAIRS = [("fp8_e4m3", 32), ("fp8_e5m2", 32), ("fp8", 64), ("auto", 128)]
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""the engine core in the runner's process, where ``kv_digest`` reads the KV cache"""
STARTS = {
    "fp8_e4m3": "fp8 KV (fp8_e4m3, per-layer scales from the checkpoint)",
    "fp8_e5m2": "fp8 KV (fp8_e5m2, per-layer scales from the checkpoint)",
    "fp8": "fp8 KV (fp8, per-layer scales from the checkpoint)",
    "auto": "bf16 KV",
}


def wait_stats(
    prefix: str, cond: Callable[[dict[str, float]], bool], engine: VllmEngine
) -> dict[str, float]:
    """The engine's connector counters once ``cond`` holds."""
    wait_for(lambda: cond(stats(prefix)), f"{engine.name}'s connector counters", 120)
    return stats(prefix)


def engine(server: Proc, dtype: str, block_size: int, stats_path: str, name: str) -> VllmEngine:
    """An engine of ``dtype`` and ``block_size`` with the connector on ``server``; every
    hit claimed (the cost model is not under test here)."""
    connector = {
        "coordinators": server.ready["coordinator"],
        "local_node": server.ready["node"],
        "stats_path": stats_path,
        "transfer_timeout_s": 10.0,
        "cost_model": False,
    }
    spec = {"connector": connector, "kv_cache_dtype": dtype, "block_size": block_size}
    return VllmEngine(spec, env=IN_PROCESS, name=name)


@pytest.mark.parametrize(("dtype", "block_size"), PAIRS, ids=[f"{d}-{b}" for d, b in PAIRS])
def test_restarted_engine_loads_the_bytes_the_cold_one_computed(
    server: Proc, tmp_path: Path, dtype: str, block_size: int
) -> None:
    """``server``: the module's ``pegaflow-server`` (``tests/conftest.py``)."""
    blocks = LENGTH // block_size
    full = blocks * block_size
    s_cold, s_warm = (str(tmp_path / k) for k in ("cold", "warm"))

    cold = engine(server, dtype, block_size, s_cold, f"cold-{dtype}-{block_size}")
    try:
        line = next((x for x in cold.log if "PegaFlow: " in x and " support: " in x), "")
        assert (
            f"PegaFlow: full support: full attention, 2 KV heads per rank; {STARTS[dtype]}; "
            f"block size {block_size}"
        ) in line, cold.tail()
        r = cold.generate(P, MAX_TOKENS)
        assert r["cached"] == [0, 0]
        want_kv = [cold.kv_digest(p) for p in P]
        assert all(d is not None for ds in want_kv for d in ds) and len(want_kv[0]) == blocks
        st = wait_stats(s_cold, lambda s: s.get("save_blocks", 0) >= 2 * blocks, cold)
        # the pairs before this one saved these prompts: none of it is this one's
        assert st.get("lookup_hit_blocks", 0) == 0 and st.get("load_blocks", 0) == 0, st
        assert st.get("lookup_miss_blocks", 0) >= 2 * blocks, st  # it did ask
    finally:
        cold.stop()

    warm = engine(server, dtype, block_size, s_warm, f"warm-{dtype}-{block_size}")
    try:
        w = warm.generate(P, MAX_TOKENS)
        assert w["outputs"] == r["outputs"]
        assert w["cached"] == [full, full]  # every full block from the cluster
        assert [warm.kv_digest(p) for p in P] == want_kv  # byte-exact
        st = wait_stats(s_warm, lambda s: s.get("load_blocks", 0) >= 2 * blocks, warm)
        assert st["lookup_hit_blocks"] >= 2 * blocks
        assert st.get("load_failed_blocks", 0) == 0
        # a block: 2 layers of K and V, block_size tokens, 2 heads of 32, 1 byte per fp8
        itemsize = 2 if dtype == "auto" else 1
        assert st["load_bytes"] == st["load_blocks"] * 2 * 2 * block_size * 2 * 32 * itemsize
    finally:
        warm.stop()
