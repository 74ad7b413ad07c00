"""Pure logic of ``scripts/bench_models_gpu.py`` (issue 39) and its model configs
(``scripts/_models.py``): the families' scaled shapes and full-attention sizes, the
engine log's start line, KV cache groups and hybrid manager, the bytes per token, the KV
verdict and the command line's device defaults.  No engine is started (the script runs
end to end on the CPU with ``--device cpu``; docs/benchmarks.md "Issue 39")."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from tests.support.script_module import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """``scripts/bench_models_gpu.py`` as a module (scripts/ is not a package)."""
    return load_script("bench_models_gpu")


@pytest.fixture(scope="module")
def models(bench: ModuleType) -> ModuleType:
    """``scripts/_models.py``, as the bench imports it."""
    return sys.modules["scripts._models"]


def test_help_lists_the_families_and_switches(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        bench.parse_args(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for word in ("--families", "--eager", "--device", "--tokens", "--prompts", "--tp"):
        assert word in text
    for family in ("gpt-oss", "qwen3-next", "deepseek-v2-lite", "llama-fp8"):
        assert family in text


def test_the_families_keep_their_public_kv_shapes(models: ModuleType) -> None:
    fams = models.FAMILIES
    assert list(fams) == ["gpt-oss", "qwen3-next", "deepseek-v2-lite", "llama-fp8"]
    oss = fams["gpt-oss"].model("cuda")
    assert oss["num_hidden_layers"] == 8
    assert oss["layer_types"] == ["sliding_attention", "full_attention"] * 4
    assert (oss["sliding_window"], oss["num_key_value_heads"], oss["head_dim"]) == (128, 8, 64)
    nxt = fams["qwen3-next"].model("cuda")
    assert nxt["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert (nxt["num_key_value_heads"], nxt["head_dim"], nxt["num_experts"]) == (2, 256, 64)
    ds = fams["deepseek-v2-lite"].model("cuda")
    assert (ds["kv_lora_rank"], ds["qk_rope_head_dim"], ds["num_hidden_layers"]) == (512, 64, 8)
    llama = fams["llama-fp8"]
    assert llama.kv_cache_dtype == "fp8"
    assert llama.model("cuda") == models.LLAMA_31_8B  # the whole model on the GPU
    # --layers overrides every family's count; the public configs stay as published
    assert fams["gpt-oss"].model("cuda", layers=24)["num_hidden_layers"] == 24
    assert models.GPT_OSS_20B["num_hidden_layers"] == 24


def test_cpu_versions_are_tiny_and_say_what_changed(models: ModuleType) -> None:
    for fam in models.FAMILIES.values():
        m = fam.model("cpu")
        assert m["hidden_size"] == 256 and m["vocab_size"] == 1024
        assert m["num_hidden_layers"] <= 4
        assert fam.note("cpu").startswith(f"{m['num_hidden_layers']} of ")
        assert "vocab_size" in fam.note("cpu")
    assert models.FAMILIES["deepseek-v2-lite"].cpu_block_size == 16  # vLLM-CPU's MLA
    assert models.FAMILIES["llama-fp8"].note("cuda") == "32 of 32 layers"
    assert models.FAMILIES["qwen3-next"].note("cuda") == "8 of 48 layers; num_experts 512 -> 64"


def test_full_attention_bytes_per_token(models: ModuleType) -> None:
    kv = models.kv_bytes_per_token
    llama = models.LLAMA_31_8B
    assert kv(llama, 2) == 32 * 2 * 8 * 128 * 2  # 128 KiB, bf16
    assert kv(llama, 1) == 64 << 10  # fp8
    assert kv(llama, 2, tp=2) == 64 << 10  # a rank's KV heads
    ds = models.DEEPSEEK_V2_LITE
    assert kv(ds, 2) == 27 * 576 * 2  # the latent, once
    assert kv(ds, 2, tp=4) == kv(ds, 2)  # every rank holds the same latent
    assert kv(models.GPT_OSS_20B, 2) == 24 * 2 * 8 * 64 * 2


def test_dtype_bytes(bench: ModuleType) -> None:
    assert bench.dtype_bytes("fp8") == bench.dtype_bytes("fp8_e5m2") == 1
    assert bench.dtype_bytes("auto") == 2
    assert bench.dtype_bytes("auto", "float32") == 4


START = (
    "(EngineCore pid=7) INFO 12-07 [connector.py:80] PegaFlow: partial support: hybrid "
    "attention under vLLM's hybrid KV cache manager (2 KV cache groups: FullAttentionSpec, "
    "SlidingWindowSpec): each group's blocks stored; bf16 KV; block size 16"
)


def test_start_line_groups_and_hybrid_manager(bench: ModuleType) -> None:
    log = ["INFO starting", START, "PegaFlow: full support: later line"]
    line = bench.support_line(log)
    assert line is not None and line.startswith("PegaFlow: partial support: hybrid attention")
    assert bench.kv_cache_groups(line) == 2
    assert bench.kv_cache_groups("PegaFlow: full support: full attention, 8 KV heads") == 1
    assert bench.kv_cache_groups(None) is None
    assert bench.support_line(["no connector here"]) is None
    assert bench.engine_block_size(line, 32) == 16
    assert bench.engine_block_size(None, 32) == 32
    assert bench.hybrid_manager(log)
    off = "WARNING Turning off hybrid kv cache manager because `--kv-transfer-config` ..."
    assert not bench.hybrid_manager([*log, off])


def test_byte_figures_per_token_against_full_attention(bench: ModuleType) -> None:
    before = {"put_bytes": 1000.0, "used_bytes": 4096.0}
    after = {"put_bytes": 1000.0 + 4 * 8000 * 512, "used_bytes": 4096.0 + 4 * 8000 * 520}
    got = bench.byte_figures(before, after, tokens=4 * 8000, full=1024, requests=4)
    assert got["stored_bytes"] == 4 * 8000 * 512
    assert got["pool_used_bytes"] == 4 * 8000 * 520
    assert got["bytes_per_token"] == 512.0
    assert got["stored_over_full_attention"] == 0.5
    assert got["bytes_per_request"] == 8000 * 512
    none = bench.byte_figures({}, {}, tokens=0, full=1024, requests=0)
    assert none["bytes_per_token"] is None and none["bytes_per_request"] is None


def test_full_blocks_and_ratios(bench: ModuleType) -> None:
    assert bench.full_blocks_tokens([[1] * 100, [1] * 64], 32) == 96 + 64
    assert bench.ratio(1, 4) == 0.25
    assert bench.ratio(None, 4) is None and bench.ratio(1, 0) is None
    assert bench.mean_ms([1.0, 2.0]) == 1.5 and bench.mean_ms([]) is None


def test_kv_verdict(bench: ModuleType) -> None:
    # per prompt, per group, per block
    cold = [[["a", "b", "c"]], [["d", "e", "f"]]]
    same = bench.kv_verdict(cold, cold, [0, 0], [64, 64], 32)
    assert same == {"kv_match": True, "kv_blocks": 4, "kv_mismatches": 0}
    wrong = bench.kv_verdict(cold, [[["a", "x", "c"]], [["d", "e", "f"]]], [0, 0], [64, 64], 32)
    assert wrong["kv_match"] is False and wrong["kv_mismatches"] == 1
    # the block after the hit was computed by the warm engine: not compared
    tail = [[["a", "b", "z"]], [["d", "e", "z"]]]
    assert bench.kv_verdict(cold, tail, [0, 0], [64, 64], 32)["kv_match"]
    # a full-attention block the warm engine lacks is a mismatch
    assert not bench.kv_verdict(cold, [[["a", None, "c"]], [["d", "e", "f"]]], [0, 0],
                                [64, 64], 32)["kv_match"]  # fmt: skip

    def note(**kw: object) -> object:
        args = {"cold": cold, "warm": cold, "cold_cached": [0, 0], "warm_cached": [64, 64],
                "block_size": 32, **kw}  # fmt: skip
        got = bench.kv_verdict(**args)
        assert got["kv_match"] is None
        return got["kv_note"]

    assert note(warm="--tp 2: kv_digest reads one rank's KV").startswith("--tp 2")
    assert "cold engine had hits" in str(note(cold_cached=[32, 0]))
    assert note(warm_cached=[0, 0]) == "no hit to compare"
    # vLLM-CPU turns its prefix cache off for MLA: kv_digest finds no block
    nothing = [[[None] * 3]] * 2
    assert "kept no block" in str(note(cold=nothing, warm=nothing))


def test_kv_verdict_with_a_sliding_window_group(bench: ModuleType) -> None:
    """Group 0 a sliding window (the warm engine holds only the window's last blocks),
    group 1 full attention (every hit block)."""
    cold = [[["w0", "w1", "w2", "w3"], ["f0", "f1", "f2", "f3"]]]
    warm = [[[None, None, "w2", "w3"], ["f0", "f1", "f2", "f3"]]]
    got = bench.kv_verdict(cold, warm, [0], [128], 32, windows=frozenset({0}))
    assert got == {"kv_match": True, "kv_blocks": 6, "kv_mismatches": 0}
    bad = [[[None, None, "wX", "w3"], ["f0", "f1", "f2", "f3"]]]
    assert bench.kv_verdict(cold, bad, [0], [128], 32, frozenset({0}))["kv_mismatches"] == 1
    # without the window known, the missing blocks count
    assert bench.kv_verdict(cold, warm, [0], [128], 32)["kv_mismatches"] == 2


def test_start_error_reason(bench: ModuleType) -> None:
    err = RuntimeError(
        "gpt-oss-plain did not start:\nTraceback (most recent call last):\n  File x\n"
        "ValueError: Model architectures ['GptOssForCausalLM'] failed to be inspected\n"
        "  more context"
    )
    assert bench.first_error_line(err).startswith("ValueError: Model architectures")
    assert bench.first_error_line(RuntimeError("")) == "RuntimeError"


def test_device_defaults(bench: ModuleType) -> None:
    cpu = bench.parse_args(["--device", "cpu", "--families", "llama-fp8"])
    assert (cpu.tokens, cpu.kv_cache_gb, cpu.pool_size, cpu.coordinator_port) == (
        256, 0.25, "1GiB", 0
    )  # fmt: skip
    assert cpu.family_names == ["llama-fp8"]
    gpu = bench.parse_args(["--device", "cuda"])
    assert (gpu.tokens, gpu.prompts, gpu.coordinator_port, gpu.pool_size) == (8000, 4, 7700, None)
    assert gpu.family_names == ["gpt-oss", "qwen3-next", "deepseek-v2-lite", "llama-fp8"]
    assert not gpu.eager
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--families", "mixtral"])


def test_group_digests_read_each_groups_blocks_over_its_own_layers() -> None:
    """``kv_digest`` under the hybrid KV cache manager (``tests/support/vllm_runner.py``):
    the layers of group 0 (a sliding window) and group 1 (full attention) interleave, as
    gpt-oss's do; each group's block of a hash is digested over that group's layers."""
    import torch

    from tests.support.vllm_runner import _group_digests, block_digests

    num_blocks = 6
    caches = [torch.randn(2, num_blocks, 32, 2, 8) for _ in range(4)]  # layers 0..3

    def group(kind: str, layers: list[int]) -> SimpleNamespace:
        names = [f"model.layers.{i}.self_attn.attn" for i in layers]
        return SimpleNamespace(layer_names=names, kv_cache_spec=type(kind, (), {})())

    groups = [group("SlidingWindowSpec", [0, 2]), group("FullAttentionSpec", [1, 3])]
    held = {("h0", 0): None, ("h1", 0): 4, ("h0", 1): 2, ("h1", 1): 5}

    class Pool:
        num_gpu_blocks = num_blocks

        def get_cached_block(self, h: str, gids: list[int]) -> list[SimpleNamespace] | None:
            b = held[(h, gids[0])]
            return None if b is None else [SimpleNamespace(block_id=b)]

    def index(name: str) -> int:  # vLLM's extract_layer_index, for these names
        return int(name.split(".")[2])

    got = _group_digests(["h0", "h1"], Pool(), caches, groups, index)
    assert got["specs"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    window, full = got["groups"]
    assert window[0] is None
    assert window[1] == block_digests([caches[0], caches[2]], [4], num_blocks)[0]
    assert full == block_digests([caches[1], caches[3]], [2, 5], num_blocks)
    assert got["digests"] == window


def test_a_family_the_engine_cannot_start_is_skipped_with_the_reason(
    bench: ModuleType, models: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    class NoEngine:
        def __init__(self, *a: object, **kw: object) -> None:
            raise RuntimeError(
                "qwen3-next-plain did not start:\nTraceback (most recent call last):\n"
                "NotImplementedError: no Gated DeltaNet kernel on this platform"
            )

    monkeypatch.setattr(bench, "VllmEngine", NoEngine)
    args = bench.parse_args(["--device", "cpu", "--families", "qwen3-next"])
    server = SimpleNamespace(ready={"coordinator": "127.0.0.1:1", "http": "1"})
    got = bench.FamilyRun(models.FAMILIES["qwen3-next"], args, server, tmp_path).run()
    assert got["skipped"] == (
        "vLLM on cpu did not start it: NotImplementedError: no Gated DeltaNet kernel on this "
        "platform"
    )
    assert got["model"] == "Qwen3NextForCausalLM" and "cold_ms" not in got
    assert (tmp_path / "qwen3-next" / "config.json").exists()
