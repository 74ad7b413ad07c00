"""The start line: which support applies to an engine's model and options, decided in
one place (:func:`pegaflow.connector.compat.model_support`) from its KV cache."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from pegaflow.connector.compat import EngineGeometry, model_support


class MambaSpec(SimpleNamespace):
    """Named as vLLM's spec of a Mamba / linear-attention group."""

DENSE = EngineGeometry(
    block_size=16, num_blocks=64, num_layers=2, num_kv_heads=8, head_size=128,
    kv_dtype="bfloat16", page_bytes=65536, layout="NHD", specs=("FullAttentionSpec",),
)  # fmt: skip


def support(**changes: Any) -> tuple[str, str]:
    tp = changes.pop("tp", 1)
    pp = changes.pop("pp", 1)
    s = model_support(replace(DENSE, **changes), tp, pp)
    return s.level, s.line()


def test_dense_models_with_tested_dtypes_and_block_sizes_have_full_support() -> None:
    assert support() == (
        "full",
        "PegaFlow: full support: full attention, 8 KV heads per rank; bf16 KV; block size 16",
    )
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        level, line = support(cache_dtype=dtype, kv_dtype="uint8", block_size=128)
        assert level == "full"
        assert f"fp8 KV ({dtype}, per-layer scales from the checkpoint); block size 128" in line
    level, line = support(tp=2)
    assert level == "full" and line.endswith("; TP 2: one shard per rank")


def test_what_is_not_done_says_what_happens_today() -> None:
    hybrid = {
        "specs": ("FullAttentionSpec", "SlidingWindowSpec"), "block_sizes": (16, 16),
        "windows": (0, 128),
    }  # fmt: skip
    level, line = support(**hybrid)
    assert level == "partial"
    assert "hybrid attention under vLLM's hybrid KV cache manager (2 KV cache groups" in line
    assert "sliding-window groups stored in the window before each point" in line
    assert line.endswith("no P/D handoff; untested on GPUs")
    # vLLM 0.26 cannot recompute a failed load of several groups (no failed_recving)
    s = model_support(replace(DENSE, **hybrid), hybrid_recompute=False)
    assert s.level == "off" and "--disable-hybrid-kv-cache-manager" in s.line()
    level, line = support(**{**hybrid, "block_sizes": (16, 32)})
    assert level == "off"
    assert line.startswith("PegaFlow: off support: 2 KV cache groups (FullAttentionSpec, ")
    assert "connector off" in line
    level, line = support(specs=("FullAttentionSpec", "MambaSpec"), block_sizes=(16, 16))
    assert level == "off" and "Mamba / linear-attention state" in line
    assert "mamba_cache_mode align" in line and "here none" in line
    assert support(specs=("MambaSpec",))[0] == "off"
    assert support(specs=("SlidingWindowSpec",))[0] == "partial"
    # gpt-oss, Gemma 3 under this connector: vLLM keeps sliding layers as full attention
    level, line = support(window=128)
    assert level == "partial" and "windowed layers (window 128) kept whole" in line
    assert support(specs=("ChunkedLocalAttentionSpec",))[0] == "partial"
    assert support(pp=2)[0] == "partial"
    level, line = support(cache_dtype="nvfp4", kv_dtype="uint8")
    assert level == "partial" and "nvfp4 KV: vLLM's pages copied as bytes (untested)" in line


def test_mla_is_stored_once_at_every_tp() -> None:
    level, line = support(specs=("MLAAttentionSpec",), num_kv_heads=1, head_size=576, tp=2)
    assert level == "full"
    assert "MLA: the latent KV stored once, by TP rank 0, loaded by every rank" in line
    assert line.endswith("; TP 2: one shard per stage")
    assert not replace(DENSE, specs=("MLAAttentionSpec", "FullAttentionSpec")).mla


def test_fp8_scales_computed_at_run_time_turn_the_connector_off() -> None:
    """Scales taken from each engine's first batch differ between engines: the same
    tokens' fp8 bytes would too."""
    level, line = support(cache_dtype="fp8", kv_dtype="uint8", dynamic_kv_scales=True)
    assert level == "off" and "calculate_kv_scales" in line
    assert support(dynamic_kv_scales=True)[0] == "full"  # bf16: no scales at all


def test_the_facade_logs_the_line_and_follows_it(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    from unittest import mock

    from pegaflow.connector import PegaKVConnector
    from pegaflow.connector.compat import KVConnectorRole

    from tests.support.connector_fakes import FakeCluster, kv_cache_config, vllm_config

    log = logging.getLogger("pegaflow.connector")  # it does not propagate (vLLM's handler)
    log.addHandler(caplog.handler)
    try:
        with (
            caplog.at_level(logging.INFO, "pegaflow.connector"),
            mock.patch.object(PegaKVConnector, "_make_client", lambda self: FakeCluster()),
        ):
            conn = PegaKVConnector(vllm_config(), KVConnectorRole.SCHEDULER, kv_cache_config())
            conn.shutdown()
            mamba = kv_cache_config(groups=2)
            mamba.kv_cache_groups[1].kv_cache_spec = MambaSpec(block_size=32)
            off = PegaKVConnector(vllm_config(), KVConnectorRole.SCHEDULER, mamba)
            off.shutdown()
    finally:
        log.removeHandler(caplog.handler)
    assert conn.support.level == "full" and conn.settings.mode != "off"
    assert off.support.level == "off" and off.settings.mode == "off"
    # (a record may be captured twice: through this handler and, where an earlier test
    # left the logger propagating, through the root logger's)
    said = [r.getMessage() for r in caplog.records]
    lines = list(dict.fromkeys(x for x in said if "support:" in x))
    assert lines[0] == (
        "PegaFlow: full support: full attention, 2 KV heads per rank; bf16 KV; block size 32"
    )
    assert lines[1].startswith("PegaFlow: off support: 2 KV cache groups")


def test_mamba_states_kept_at_block_boundaries_are_stored() -> None:
    """vLLM 0.32 with prefix caching keeps a Mamba group's state at block boundaries
    (``mamba_cache_mode`` ``align``) and names each one's block: then such groups are
    stored; without prefix caching (``none``) nothing is kept, and the connector is off."""
    states = {
        "specs": ("MambaSpec", "FullAttentionSpec"), "block_sizes": (256, 256),
        "states": (True, False),
    }  # fmt: skip
    level, line = support(**states, state_mode="align", state_cache="[[3, 512]]['bfloat16']")
    assert level == "partial"
    assert "hybrid attention under vLLM's hybrid KV cache manager (2 KV cache groups" in line
    assert "Mamba / linear-attention groups: the state at each block boundary" in line
    level, line = support(**states, state_mode="none", state_cache="[[3, 512]]['bfloat16']")
    assert level == "off" and "here none" in line
