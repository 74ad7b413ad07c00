"""The Llama configs the vLLM benchmarks and the demo run with dummy weights."""

from __future__ import annotations

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
