"""KV caches of one byte per element (fp8 KV: vLLM allocates it as ``uint8``; float8
dtypes in case a backend types it so): whole blocks copied out and back byte-exact, in
tile and strided layouts, and a block's bytes follow the element size."""

from __future__ import annotations

import pytest
import torch
from pegaflow.connector.media.kvio import KVBlockIO

NB = 16


def caches(dtype: torch.dtype, kv_outer: bool, seed: int) -> dict[str, torch.Tensor]:
    """Two layers of vLLM's CPU layout ``(blocks, heads, block_size, 2 * head_size)``,
    or with ``kv_outer`` FlashAttention's ``(2, blocks, block_size, heads, head_size)``
    (K and V outside the block dimension: no whole-tile memcpy)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, NB, 32, 2, 32) if kv_outer else (NB, 2, 32, 64)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randint(
            0, 256, shape, dtype=torch.uint8, generator=g
        ).view(dtype)
        for i in range(2)
    }


def block(t: torch.Tensor, i: int, kv_outer: bool) -> bytes:
    """Block ``i``'s bytes of one layer."""
    return (t[:, i] if kv_outer else t[i]).contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("kv_outer", [False, True], ids=["tile", "strided"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_one_byte_kv_blocks_round_trip_byte_exact(dtype: torch.dtype, kv_outer: bool) -> None:
    src, dst = caches(dtype, kv_outer, 1), caches(dtype, kv_outer, 2)
    a, b = KVBlockIO(src, NB), KVBlockIO(dst, NB)
    assert a.block_bytes == 2 * (2 * 32 * 64) * 1  # layers x tile elements x 1 byte
    assert all(layer.raw is None for layer in a.layers) == kv_outer
    buf, _ = a.new_staging(3)
    a.gather([3, 7, 11], buf)
    b.scatter([5, 6, 0], buf, [0, 1, 2])
    for name, t in src.items():
        for got, want in ((5, 3), (6, 7), (0, 11)):
            assert block(dst[name], got, kv_outer) == block(t, want, kv_outer)
