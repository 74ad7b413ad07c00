"""A hybrid model's Mamba / linear-attention states in the pages they share with an
attention layer (vLLM's hybrid allocator, as vLLM 0.32 lays out a Qwen3-Next): copying
the attention layer's tiles copies the states, and nothing is copied twice."""

from __future__ import annotations

import pytest
import torch
from pegaflow.connector.media.kvio import KVBlockIO

NB = 8
PAGE = 4096  # bytes of one block of the shared buffer


def shared(seed: int) -> tuple[torch.Tensor, dict[str, object]]:
    """One buffer of ``NB`` pages viewed as an attention layer's cache ``(blocks, 2,
    block_size, 2 * head_size)`` bf16 and, by two linear-attention layers, as a conv
    state (bf16 at the page's start) and an SSM state (fp32 after it); one of them also
    registered as a single tensor (as vLLM passes some)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (NB * PAGE,), dtype=torch.uint8, generator=g)
    attn = raw.view(torch.bfloat16).view(NB, 2, 16, 64)
    conv = torch.as_strided(raw.view(torch.bfloat16), (NB, 3, 64), (PAGE // 2, 64, 1))
    ssm = torch.as_strided(raw.view(torch.float32), (NB, 4, 32), (PAGE // 4, 32, 1), 96)
    return raw, {
        "model.layers.3.self_attn.attn": attn,
        "model.layers.0.linear_attn": [conv, ssm],
        "model.layers.1.linear_attn": (conv, ssm),
        "model.layers.2.linear_attn": torch.as_strided(
            raw, (NB, 384 + 512), (PAGE, 1)
        ),  # conv and ssm bytes as one tensor
    }


def test_states_inside_an_attention_layers_pages_travel_with_it() -> None:
    src_raw, src = shared(1)
    dst_raw, dst = shared(2)
    a, b = KVBlockIO(src, NB), KVBlockIO(dst, NB)  # type: ignore[arg-type]
    assert [layer.name for layer in a.layers] == ["model.layers.3.self_attn.attn"]
    assert a.block_bytes == PAGE
    assert set(a.layer_of.values()) == {0} and len(a.layer_of) == 2
    buf, _ = a.new_staging(2)
    a.gather([1, 6], buf)
    b.scatter([4, 0], buf, [0, 1])
    for got, want in ((4, 1), (0, 6)):
        assert torch.equal(
            dst_raw[got * PAGE : (got + 1) * PAGE], src_raw[want * PAGE : (want + 1) * PAGE]
        )


def test_a_state_outside_every_attention_page_is_refused() -> None:
    _, kv = shared(1)
    apart = torch.zeros((NB, 3, 64), dtype=torch.bfloat16)  # its own memory
    kv["model.layers.0.linear_attn"] = [apart]
    with pytest.raises(ValueError, match="not inside the pages"):
        KVBlockIO(kv, NB)  # type: ignore[arg-type]
