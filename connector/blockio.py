"""Copies between vLLM's paged KV cache and host staging buffers, one block at a time.

A stored block is one vLLM block of one rank: for each layer (in a fixed, sorted
order) the bytes of that block id in the layer's KV cache, concatenated.  Per layer the
block is treated as an opaque tile of bytes: on the CPU backend that is the
``(H, N, 2*D)`` tile vLLM views as ``(H, 2N, D)`` with K packed before V, on CUDA
backends whatever the backend's layout is.  Tiles are copied whole, never sliced per
token, so the connector never needs to understand the layout; the namespace carries
the layout so that engines with different layouts never share blocks.

When the block dimension is outermost in memory (every vLLM backend today) a layer is
viewed as a ``(num_blocks, tile_bytes)`` byte matrix and a block copy is one contiguous
``memcpy`` per layer.  Other layouts fall back to strided copies of the block slice.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


@dataclass
class _Layer:
    name: str
    raw: torch.Tensor | None
    """(num_blocks, tile_bytes) uint8 view when blocks are contiguous tiles"""
    moved: torch.Tensor
    """the layer with the block dimension first (fallback path)"""
    tile_bytes: int
    split: int
    """kernel blocks per vLLM block (1 unless the backend splits blocks)"""


class KVBlockIO:
    """Gather / scatter whole blocks of every layer of one rank's KV cache.

    Args:
        kv_caches: vLLM's per-layer KV cache tensors, as given to ``register_kv_caches``.
        num_blocks: vLLM's number of KV blocks (``kv_cache_config.num_blocks``).
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors to register")
        self.num_blocks = num_blocks
        self.layers: list[_Layer] = []
        seen: dict[tuple[int, int], str] = {}
        for name in sorted(kv_caches, key=_natural_key):
            t = kv_caches[name]
            key = (t.data_ptr(), t.numel())
            if key in seen:  # layers sharing one cache (e.g. KV sharing): copy once
                continue
            seen[key] = name
            self.layers.append(self._layer(name, t, num_blocks))
        self.device = kv_caches[self.layers[0].name].device
        self.is_cpu = self.device.type == "cpu"
        self.block_bytes = sum(layer.tile_bytes for layer in self.layers)
        self._offsets: list[int] = []
        off = 0
        for layer in self.layers:
            self._offsets.append(off)
            off += layer.tile_bytes
        self._stream: Any = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)

    @staticmethod
    def _layer(name: str, t: torch.Tensor, num_blocks: int) -> _Layer:
        dims = [d for d in range(t.dim()) if t.shape[d] and t.shape[d] % num_blocks == 0]
        if not dims:
            raise ValueError(
                f"layer {name}: no dimension of shape {tuple(t.shape)} matches {num_blocks} blocks"
            )
        bdim = max(dims, key=lambda d: (t.stride(d), -d))
        split = t.shape[bdim] // num_blocks
        moved = t.movedim(bdim, 0)
        itemsize = t.element_size()
        rest = [(moved.stride(i), moved.shape[i]) for i in range(1, moved.dim())]
        rest.sort(reverse=True)
        expect = 1
        dense = True
        for stride, size in reversed(rest):
            if size != 1 and stride != expect:
                dense = False
                break
            expect *= size
        tile_elems = 1
        for size in moved.shape[1:]:
            tile_elems *= size
        raw = None
        if dense and t.stride(bdim) == tile_elems:
            raw = torch.as_strided(
                t, (num_blocks, split * tile_elems), (split * tile_elems, 1), t.storage_offset()
            ).view(torch.uint8)
        tile_bytes = split * tile_elems * itemsize
        return _Layer(name, raw, moved, tile_bytes, split)

    def describe(self) -> str:
        """Human-readable layout summary (for logs)."""
        kinds = {"tile" if layer.raw is not None else "strided" for layer in self.layers}
        return (
            f"{len(self.layers)} layers, {self.block_bytes} bytes/block "
            f"({self.layers[0].tile_bytes} per layer), {'/'.join(sorted(kinds))} copies, "
            f"device {self.device}"
        )

    # ---- staging -------------------------------------------------------------------

    def new_staging(self, nblocks: int) -> tuple[torch.Tensor, np.ndarray]:
        """A host buffer for ``nblocks`` blocks: (tensor, numpy view), pinned on CUDA."""
        t = torch.empty((nblocks, self.block_bytes), dtype=torch.uint8, pin_memory=not self.is_cpu)
        return t, t.numpy()

    def record_step(self) -> Any:
        """A marker after the work queued so far on the compute stream (CUDA), else None."""
        if self._stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    # ---- copies --------------------------------------------------------------------

    def _ids(self, block_ids: Sequence[int], split: int) -> list[int]:
        if split == 1:
            return list(block_ids)
        return [b * split + k for b in block_ids for k in range(split)]

    def gather(self, block_ids: Sequence[int], out: torch.Tensor, after: Any = None) -> None:
        """Copy blocks ``block_ids`` of every layer into ``out[:len(block_ids)]``."""
        n = len(block_ids)
        if n == 0:
            return
        for bid in block_ids:
            if not 0 <= bid < self.num_blocks:
                raise IndexError(f"block id {bid} out of range")
        if self.is_cpu:
            idx = torch.tensor(list(block_ids), dtype=torch.long)
            for layer, off in zip(self.layers, self._offsets, strict=True):
                dst = out[:n, off : off + layer.tile_bytes]
                if layer.raw is not None:
                    torch.index_select(layer.raw, 0, idx, out=dst)
                else:
                    src = layer.moved.index_select(0, self._split_idx(idx, layer.split))
                    dst.copy_(src.contiguous().view(n, -1).view(torch.uint8))
            return
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            idx = torch.tensor(list(block_ids), dtype=torch.long).to(self.device)
            parts = []
            for layer in self.layers:
                if layer.raw is not None:
                    parts.append(layer.raw.index_select(0, idx))
                else:
                    src = layer.moved.index_select(0, self._split_idx(idx, layer.split))
                    parts.append(src.contiguous().view(n, -1).view(torch.uint8))
            out[:n].copy_(torch.cat(parts, dim=1), non_blocking=True)
            self._stream.synchronize()

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, rows: Sequence[int]) -> None:
        """Copy ``src[rows[i]]`` into block ``block_ids[i]`` of every layer."""
        n = len(block_ids)
        if n == 0:
            return
        for bid in block_ids:
            if not 0 <= bid < self.num_blocks:
                raise IndexError(f"block id {bid} out of range")
        rows_l = list(rows)
        if self.is_cpu:
            ids = np.asarray(list(block_ids), dtype=np.int64)
            src_np = src.numpy()
            contiguous_rows = rows_l == list(range(rows_l[0], rows_l[0] + n))
            for layer, off in zip(self.layers, self._offsets, strict=True):
                part = (
                    src_np[rows_l[0] : rows_l[0] + n, off : off + layer.tile_bytes]
                    if contiguous_rows
                    else src_np[rows_l, off : off + layer.tile_bytes]
                )
                if layer.raw is not None:
                    layer.raw.numpy()[ids] = part
                else:
                    self._scatter_strided(layer, ids, torch.from_numpy(np.ascontiguousarray(part)))
            return
        with torch.cuda.stream(self._stream):
            host = (
                src[rows_l]
                if rows_l != list(range(rows_l[0], rows_l[0] + n))
                else src[rows_l[0] : rows_l[0] + n]
            )
            dev = host.to(self.device, non_blocking=True)
            idx = torch.tensor(list(block_ids), dtype=torch.long).to(self.device)
            for layer, off in zip(self.layers, self._offsets, strict=True):
                part = dev[:, off : off + layer.tile_bytes]
                if layer.raw is not None:
                    layer.raw.index_copy_(0, idx, part.contiguous())
                else:
                    self._scatter_strided(layer, idx, part.contiguous())
            self._stream.synchronize()

    @staticmethod
    def _split_idx(idx: torch.Tensor, split: int) -> torch.Tensor:
        if split == 1:
            return idx
        k = torch.arange(split, device=idx.device)
        return (idx[:, None] * split + k[None, :]).reshape(-1)

    def _scatter_strided(self, layer: _Layer, idx: Any, part: torch.Tensor) -> None:
        m = layer.moved
        if isinstance(idx, np.ndarray):
            idx = torch.from_numpy(idx)
        idx = self._split_idx(idx.to(m.device), layer.split)
        vals = part.reshape(-1).view(m.dtype).view(len(idx), *m.shape[1:])
        m[idx] = vals.to(m.device)
