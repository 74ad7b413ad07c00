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
vLLM's cross-layer layout (one tensor, all layers of a block contiguous) registers as a
single "layer" whose tile is the whole block.  A Mamba layer's state tensors (a list)
are not copied on their own: vLLM lays them out inside the pages of the attention
layers' tensors it shares them with (:meth:`KVBlockIO._drop_covered`), so copying those
pages copies the states of the blocks too; state tensors outside every attention
layer's pages are refused.

Two families of copies:

* :meth:`KVBlockIO.gather` / :meth:`KVBlockIO.scatter` move whole chunks through a host
  staging buffer (the UCX path: blocks arrive in staging, then go to the device).
* :meth:`KVBlockIO.copy_in` / :meth:`KVBlockIO.copy_out` move blocks between the KV
  cache and arbitrary offsets of a host byte region (a node's pool file mapped by the
  same-host shortcut).  On CUDA, when the region is pinned and mapped, one kernel per
  layer reads or writes every block's tile straight from host memory
  (:mod:`~pegaflow.connector.media.tilecopy`), with an event per layer for layer-wise loads;
  otherwise blocks go by DMA through a device staging buffer and are scattered on the
  device.

Every CUDA call releases the GIL; the copies are queued inside
:func:`~pegaflow.transport.gil_io.quick_handback`, so that each call gets it back at once from the
engine's other busy threads.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pegaflow.transport.gil_io import quick_handback

from . import tilecopy
from .layerfeed import CopyIn, Layer, LayerFeed, Refused2D, Transfer

logger = logging.getLogger("pegaflow.connector")

_DEV_STAGING_BLOCKS = 64
"""blocks per device staging chunk of the DMA path"""
_MIN_RUN = 4
"""shortest average run of consecutive blocks for which ``auto`` loads by 2-D copies"""
_MAX_PITCH = 1 << 24
"""largest step between blocks of a run (2-D copies refuse pitches past about 2 GiB;
neighbouring slots of a pool are one slot apart)"""
_DIGEST_MUL = 0x9E3779B97F4A7C15 - (1 << 64)
_DIGEST_ADD = 0x632BE59BD9B4E019


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _inside(t: torch.Tensor, num_blocks: int, spans: Sequence[tuple[int, int]]) -> int:
    """The index in ``spans`` (``(address of block 0's tile, tile bytes)``) of a tile that
    holds ``t``'s rows block for block (its block ``b`` inside block ``b``'s tile), else
    -1."""
    if t.dim() < 1 or t.shape[0] != num_blocks or t.numel() == 0:
        return -1
    es = t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:], strict=True))
    extent = (last + 1) * es
    for i, (base, tile) in enumerate(spans):
        off = t.data_ptr() - base
        if t.stride(0) * es == tile and 0 <= off and off + extent <= tile:
            return i
    return -1


class KVBlockIO:
    """Gather / scatter whole blocks of every layer of one rank's KV cache.

    Args:
        kv_caches: vLLM's per-layer KV cache tensors, as given to ``register_kv_caches``.
        num_blocks: vLLM's number of KV blocks (``kv_cache_config.num_blocks``).
        warm_up: compile the tile kernel now (else call :meth:`warm_up` later).
    """

    def __init__(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, warm_up: bool = True
    ) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors to register")
        self.num_blocks = num_blocks
        self.layers: list[Layer] = []
        seen: dict[tuple[int, int], int] = {}
        self.layer_of: dict[str, int] = {}
        """layer name -> index in :attr:`layers` (shared caches map to one entry)"""
        states = {k: v for k, v in kv_caches.items() if isinstance(v, list | tuple)}
        for name in sorted(kv_caches.keys() - states.keys(), key=_natural_key):
            t = kv_caches[name]
            key = (t.data_ptr(), t.numel())
            if key in seen:  # layers sharing one cache (e.g. KV sharing): copy once
                self.layer_of[name] = seen[key]
                continue
            seen[key] = len(self.layers)
            self.layer_of[name] = len(self.layers)
            self.layers.append(self._layer(name, t, num_blocks))
        self._drop_covered(states, num_blocks)
        self.device = kv_caches[self.layers[0].name].device
        self.is_cpu = self.device.type == "cpu"
        self.block_bytes = sum(layer.tile_bytes for layer in self.layers)
        self._offsets: list[int] = []
        off = 0
        for layer in self.layers:
            self._offsets.append(off)
            off += layer.tile_bytes
        self._stream: Any = None
        self._save_stream: Any = None
        self._check_stream: Any = None
        self._readback_stream: Any = None
        self._dma2d_ok = True
        self._dev_staging: torch.Tensor | None = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            self._save_stream = torch.cuda.Stream(device=self.device)
            self._check_stream = torch.cuda.Stream(device=self.device)
            self._readback_stream = torch.cuda.Stream(device=self.device)
        self.kernel_ok = tilecopy.available(self.device) and all(
            layer.raw is not None and tilecopy.aligned(layer.tile_bytes, layer.raw.data_ptr(), off)
            for layer, off in zip(self.layers, self._offsets, strict=True)
        )
        """whether the tile kernel can serve this cache (tiles, 16-byte alignment)"""
        if self.kernel_ok and warm_up:
            self.warm_up()
        self.can_digest = all(
            layer.raw is not None and layer.tile_bytes % 8 == 0 and off % 8 == 0
            for layer, off in zip(self.layers, self._offsets, strict=True)
        )
        """whether :meth:`digest` works for this cache (tile layouts)"""
        self._weights: torch.Tensor | None = None

    def _drop_covered(self, states: dict[str, Sequence[torch.Tensor]], num_blocks: int) -> None:
        """Leave out the layers whose blocks lie inside another layer's tiles (vLLM's
        hybrid allocator lays a Mamba layer's state inside the pages of the attention
        layer it shares them with): copying that layer's tiles copies them.  A state
        layer (a list of tensors) must be covered so: else ValueError."""
        spans = [
            (layer.raw.data_ptr(), layer.tile_bytes) if layer.raw is not None else (0, 0)
            for layer in self.layers
        ]
        by_size = sorted(range(len(spans)), key=lambda i: -spans[i][1])
        kept: list[int] = []
        cover: dict[int, int] = {}
        for i in by_size:
            layer = self.layers[i]
            j = -1
            if layer.split == 1:
                j = _inside(layer.moved, num_blocks, [spans[k] for k in kept])
            if j >= 0 and kept[j] != i:
                cover[i] = kept[j]
            else:
                kept.append(i)
        for name, parts in states.items():
            found = [_inside(t, num_blocks, [spans[k] for k in kept]) for t in parts]
            if not parts or min(found) < 0:
                raise ValueError(
                    f"layer {name}: state tensors {[tuple(t.shape) for t in parts]} are not "
                    "inside the pages of an attention layer's KV cache"
                )
        if not kept:
            raise ValueError("no KV cache tensor to copy")
        kept.sort()
        new_index = {old: n for n, old in enumerate(kept)}
        self.layer_of = {
            name: new_index[cover.get(i, i)] for name, i in self.layer_of.items()
        }
        self.layers = [self.layers[i] for i in kept]

    @staticmethod
    def _layer(name: str, t: torch.Tensor, num_blocks: int) -> Layer:
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
        return Layer(name, raw, moved, tile_bytes, split)

    def warm_up(self) -> None:
        """Do now what the first load and the first save would do once (may run on a
        background thread: the cache's device is made current explicitly): compile the
        tile kernel's variants, make the digests' weights, and find and make one 2-D
        copy (on the H100 the first hit of a restarted engine, after a miss had made
        its first save, took 12 ms more than the next ones, mostly in its layer-wise
        start)."""
        if not self.kernel_ok:
            return
        tb = self.layers[0].tile_bytes
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            buf = torch.zeros(2 * tb, dtype=torch.uint8, device=self.device)
            offs = tilecopy.offsets_tensor([0], self.device)
            sums = torch.zeros(1, dtype=torch.int64, device=self.device)
            wts = torch.ones(tb // 8, dtype=torch.int64, device=self.device)
            for digest in (None, (wts, sums)):  # every variant loads and saves use
                tilecopy.copy_tiles(buf, offs, buf, offs, tb, digest, dst_shift=tb)
            tilecopy.copy_tiles(buf, offs, buf, offs, tb, (wts, sums), store=False)
            if self.can_digest:
                self._digest_weights()
            if tilecopy.dma2d_available():
                host = torch.zeros(2 * 16, dtype=torch.uint8, pin_memory=True)
                try:
                    tilecopy.copy_2d(buf.data_ptr(), 16, host.data_ptr(), 16, 16, 2,
                                     self._stream.cuda_stream)  # fmt: skip
                except RuntimeError as e:  # a load then finds out and uses the kernel
                    logger.info("PegaFlow: 2-D copy warm-up failed: %s", e)
        self._stream.synchronize()  # ``host`` lives until here

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
        with quick_handback():
            ev.record(torch.cuda.current_stream(self.device))
        return ev

    def follow(self, marker: Any) -> None:
        """Make the loads queued from now on wait, on the device, for ``marker`` (a
        :meth:`record_step`): blocks allocated to a new request may still be read or
        written by a step in flight."""
        if self._stream is not None and marker is not None:
            with quick_handback():
                self._stream.wait_event(marker)

    # ---- copies --------------------------------------------------------------------

    def gather(self, block_ids: Sequence[int], out: torch.Tensor, after: Any = None) -> None:
        """Copy blocks ``block_ids`` of every layer into ``out[:len(block_ids)]``."""
        self._check_ids(block_ids)
        n = len(block_ids)
        if n == 0:
            return
        if self.is_cpu:
            self._gather_rows(torch.tensor(list(block_ids), dtype=torch.long), out[:n])
            return
        with quick_handback(), torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            idx = torch.tensor(list(block_ids), dtype=torch.long).to(self.device)
            rows = torch.empty((n, self.block_bytes), dtype=torch.uint8, device=self.device)
            self._gather_rows(idx, rows)
            out[:n].copy_(rows, non_blocking=True)
        self._stream.synchronize()

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, rows: Sequence[int]) -> None:
        """Copy ``src[rows[i]]`` into block ``block_ids[i]`` of every layer."""
        self._check_ids(block_ids)
        n = len(block_ids)
        if n == 0:
            return
        rows_l = list(rows)
        first = rows_l[0]
        picked = src[first : first + n] if rows_l == list(range(first, first + n)) else src[rows_l]
        if self.is_cpu:
            self._scatter_rows(torch.tensor(list(block_ids), dtype=torch.long), picked)
            return
        with quick_handback(), torch.cuda.stream(self._stream):
            dev = picked.to(self.device, non_blocking=True)
            self._scatter_rows(torch.tensor(list(block_ids), dtype=torch.long).to(self.device), dev)
        self._stream.synchronize()

    def _gather_rows(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        """Blocks ``idx`` (on the cache's device) of every layer into the rows of ``out``
        (``(len(idx), block_bytes)`` uint8, same device), in stored byte order."""
        n = len(idx)
        for layer, off in zip(self.layers, self._offsets, strict=True):
            dst = out[:, off : off + layer.tile_bytes]
            if layer.raw is not None:
                torch.index_select(layer.raw, 0, idx, out=dst)
            else:
                src = layer.moved.index_select(0, self._split_idx(idx, layer.split))
                dst.copy_(src.contiguous().view(n, -1).view(torch.uint8))

    def _scatter_rows(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """The rows of ``rows`` (stored byte order, cache's device) into blocks ``idx``."""
        for layer, off in zip(self.layers, self._offsets, strict=True):
            part = rows[:, off : off + layer.tile_bytes].contiguous()
            if layer.raw is not None:
                layer.raw.index_copy_(0, idx, part)
            else:
                self._scatter_strided(layer, idx, part)

    @staticmethod
    def _split_idx(idx: torch.Tensor, split: int) -> torch.Tensor:
        if split == 1:
            return idx
        k = torch.arange(split, device=idx.device)
        return (idx[:, None] * split + k[None, :]).reshape(-1)

    def _scatter_strided(self, layer: Layer, idx: torch.Tensor, part: torch.Tensor) -> None:
        m = layer.moved
        idx = self._split_idx(idx.to(m.device), layer.split)
        vals = part.reshape(-1).view(m.dtype).view(len(idx), *m.shape[1:])
        m[idx] = vals.to(m.device)

    # ---- copies to and from a host byte region (same-host shortcut) ------------------

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        for bid in block_ids:
            if not 0 <= bid < self.num_blocks:
                raise IndexError(f"block id {bid} out of range")

    def _dev_stage(self) -> torch.Tensor:
        if self._dev_staging is None:
            self._dev_staging = torch.empty(
                (_DEV_STAGING_BLOCKS, self.block_bytes), dtype=torch.uint8, device=self.device
            )
        return self._dev_staging

    def _use_kernel(self, host: torch.Tensor, offsets: Sequence[int], mapped: bool) -> bool:
        return mapped and self.kernel_ok and tilecopy.aligned(host.data_ptr(), *offsets)

    def copy_in(
        self,
        host: torch.Tensor,
        offsets: Sequence[int],
        block_ids: Sequence[int],
        *,
        mapped: bool = False,
        digest: bool = False,
        mode: str = "auto",
        piece: int = 0,
    ) -> Transfer:
        """Copy block ``i`` from ``host[offsets[i]:][:block_bytes]`` into KV block
        ``block_ids[i]`` of every layer: one :class:`CopyIn` of :meth:`copy_in_many`."""
        return self.copy_in_many([CopyIn(host, offsets, block_ids, mapped, digest, piece)], mode)[0]

    def copy_in_many(
        self, loads: Sequence[CopyIn], mode: str = "auto", ahead: int = 0
    ) -> list[Transfer]:
        """Queue several loads at once (e.g. every layer-wise load of one step), one
        :class:`Transfer` each.

        On CUDA the copies are queued on the connector's stream *layer-major*: layer
        ``k`` of every load before layer ``k + 1`` of any, with one event per layer
        shared by all the loads.  A forward pass that waits for layer ``k`` of all its
        requests then waits for ``k + 1`` layers' worth of the bytes, not for every
        earlier request's whole prefix (a batch of eight 10,000-token hits: its first
        layer could start after 7/8 of all the copies).  ``ahead`` (> 0) queues only
        that many layers now and each later one when the forward pass waits for the
        layer ``ahead`` before it (:meth:`Transfer.wait_layer`): fewer copies in
        flight when a kernel CUDA loads lazily synchronizes the context.  On the CPU
        the copies are done on return.

        ``mode`` (pinned memory, tile layouts): ``dma2d`` moves each layer's tiles with
        the copy engines, one 2-D copy per run of blocks that are consecutive both in
        ``host`` and in the cache (a prefix saved at once usually is), and a read-only
        kernel computes the digests behind them; ``kernel`` has the SMs copy every tile
        and sum the digests on the way; ``auto`` takes ``dma2d`` for a load whose runs
        average at least :data:`_MIN_RUN` blocks (falling back to the kernel for good
        if a 2-D copy is refused), else ``kernel``.  Otherwise (or ``mode="dma"``)
        blocks go through a device staging buffer, all layers at once.
        """
        for ld in loads:
            self._check_ids(ld.block_ids)
        if self.is_cpu:
            return [self._copy_in_cpu(ld) for ld in loads]
        ways = [self._way(ld, mode) for ld in loads]
        try:
            with quick_handback():
                feed = LayerFeed(self, loads, ways, ahead)
        except Refused2D as e:  # the copies queued so far are redone by the kernel
            if mode == "dma2d":
                raise RuntimeError(str(e)) from e
            self._dma2d_ok = False
            logger.warning("PegaFlow: 2-D copies failed (%s); loads use the tile kernel", e)
            return self.copy_in_many(loads, mode, ahead)
        return [
            Transfer(feed.sums[j], None if way == "none" else feed, j, way == "2d" and ld.digest)
            for j, (ld, (way, _)) in enumerate(zip(loads, ways, strict=True))
        ]

    def _copy_in_cpu(self, ld: CopyIn) -> Transfer:
        n = len(ld.block_ids)
        if n:
            bb = self.block_bytes
            rows = torch.stack([ld.host[o : o + bb] for o in ld.offsets])
            self._scatter_rows(torch.tensor(list(ld.block_ids), dtype=torch.long), rows)
        return Transfer(self.digest(ld.block_ids) if ld.digest and n else None)

    def _way(self, ld: CopyIn, mode: str) -> tuple[str, list[tuple[int, int, int]]]:
        """How :meth:`copy_in_many` moves one load: ``("2d", runs)``, ``("kernel", [])``,
        ``("dma", [])`` or ``("none", [])`` (no blocks)."""
        n = len(ld.block_ids)
        if n == 0:
            return "none", []
        if mode == "dma" or not self._use_kernel(ld.host, ld.offsets, ld.mapped):
            return "dma", []
        if (mode == "dma2d" or (mode == "auto" and self._dma2d_ok)) and tilecopy.dma2d_available():
            runs = self._runs(ld.offsets, ld.block_ids, ld.piece)
            if mode == "dma2d" or len(runs) * _MIN_RUN <= n:
                return "2d", runs
        return "kernel", []

    @staticmethod
    def _runs(
        offsets: Sequence[int], block_ids: Sequence[int], piece: int = 0
    ) -> list[tuple[int, int, int]]:
        """``(first index, length, host pitch)`` of the runs of blocks that lie at equal
        steps in host memory, within one pinned piece, and have consecutive ids in the
        cache."""
        runs: list[tuple[int, int, int]] = []
        i, n = 0, len(offsets)
        while i < n:
            j = i + 1
            pitch = offsets[j] - offsets[i] if j < n else 0
            while (
                j < n
                and 0 < pitch <= _MAX_PITCH
                and offsets[j] - offsets[j - 1] == pitch
                and block_ids[j] == block_ids[j - 1] + 1
                and (not piece or offsets[j] // piece == offsets[i] // piece)
            ):
                j += 1
            runs.append((i, j - i, pitch if j - i > 1 else 0))
            i = j
        return runs

    def _tile_offsets(self, block_ids: Sequence[int]) -> dict[int, torch.Tensor]:
        """Per tile size of the layers: the kernel's offsets of blocks ``block_ids``."""
        sizes = {layer.tile_bytes for layer in self.layers}
        return {tb: tilecopy.offsets_tensor(block_ids, self.device, tb) for tb in sizes}

    def _digest_args(
        self, off: int, tile_bytes: int, sums: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if sums is None:
            return None
        return self._digest_weights()[off // 8 : (off + tile_bytes) // 8], sums

    def _copy_in_dma(
        self, host: torch.Tensor, offsets: Sequence[int], block_ids: Sequence[int]
    ) -> None:
        bb = self.block_bytes
        if len(self.layers) == 1 and self.layers[0].raw is not None:  # cross-layer: direct
            raw = self.layers[0].raw
            for off, bid in zip(offsets, block_ids, strict=True):
                raw[bid].copy_(host[off : off + bb], non_blocking=True)
            return
        stage = self._dev_stage()
        for start in range(0, len(block_ids), _DEV_STAGING_BLOCKS):
            ids = block_ids[start : start + _DEV_STAGING_BLOCKS]
            for j, off in enumerate(offsets[start : start + len(ids)]):
                stage[j].copy_(host[off : off + bb], non_blocking=True)
            idx = torch.tensor(list(ids), dtype=torch.long).to(self.device, non_blocking=True)
            self._scatter_rows(idx, stage[: len(ids)])

    def copy_out(
        self,
        block_ids: Sequence[int],
        host: torch.Tensor,
        offsets: Sequence[int],
        *,
        mapped: bool = False,
        after: Any = None,
        digest: bool = False,
    ) -> torch.Tensor | None:
        """Copy KV block ``block_ids[i]`` of every layer to ``host[offsets[i]:]``; returns
        when the bytes are in host memory.  ``after``: a :meth:`record_step` marker the
        copy must follow (the forward pass that wrote the blocks).  ``digest``: also
        return each block's :meth:`digest` (an int64 tensor on the cache's device)."""
        self._check_ids(block_ids)
        n = len(block_ids)
        if n == 0:
            return torch.zeros(0, dtype=torch.int64) if digest else None
        bb = self.block_bytes
        if self.is_cpu:
            rows = torch.empty((n, bb), dtype=torch.uint8)
            self._gather_rows(torch.tensor(list(block_ids), dtype=torch.long), rows)
            for j, off in enumerate(offsets):
                host[off : off + bb].copy_(rows[j])
            return self.digest(block_ids) if digest else None
        sums = None
        with quick_handback(), torch.cuda.stream(self._save_stream):
            if after is not None:
                self._save_stream.wait_event(after)
            if self._use_kernel(host, offsets, mapped):
                dst = tilecopy.RawPointer(host.data_ptr())
                dst_off = tilecopy.offsets_tensor(offsets, self.device)
                src_off = self._tile_offsets(block_ids)
                if digest:
                    sums = torch.zeros(n, dtype=torch.int64, device=self.device)
                for layer, off in zip(self.layers, self._offsets, strict=True):
                    assert layer.raw is not None
                    tilecopy.copy_tiles(
                        layer.raw,
                        src_off[layer.tile_bytes],
                        dst,
                        dst_off,
                        layer.tile_bytes,
                        self._digest_args(off, layer.tile_bytes, sums),
                        dst_shift=off,
                    )
            else:
                if digest:
                    sums = self._digest(block_ids)
                stage = self._dev_stage()
                for start in range(0, n, _DEV_STAGING_BLOCKS):
                    ids_l = list(block_ids[start : start + _DEV_STAGING_BLOCKS])
                    m = len(ids_l)
                    idx = torch.tensor(ids_l, dtype=torch.long).to(self.device)
                    self._gather_rows(idx, stage[:m])
                    # same stream: the next chunk's gather waits for these copies
                    for j, off in enumerate(offsets[start : start + m]):
                        host[off : off + bb].copy_(stage[j], non_blocking=True)
        self._save_stream.synchronize()
        return sums

    def to_host(self, t: torch.Tensor) -> np.ndarray:
        """``t`` (a small tensor on the cache's device, such as :meth:`copy_out`'s or a
        load's digests) as a host array.  The caller has already waited for what made
        it (synchronized its event or stream).  The copy goes on a stream of its own:
        ``t.cpu()`` would copy on the caller's current stream, behind everything queued
        there.  With vLLM's asynchronous scheduling that is the next step's forward pass,
        which waits for that step's loads, so a step's load check waited for the step
        after it."""
        if t.device.type != "cuda":
            return t.numpy()
        with quick_handback(), torch.cuda.stream(self._readback_stream):
            return t.cpu().numpy()

    def digest(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A 64-bit digest of each block, computed where the KV cache lives.

        The digest is a position-weighted sum of the block's 64-bit words, modulo 2**64
        (weights odd and distinct per position), over the block's bytes in stored order.
        It detects any changed word and any moved words; on a GPU the copies compute it
        on the way (``copy_in``/``copy_out`` with ``digest=True``), where recomputing the
        xxh3 on host costs tens of milliseconds of CPU for a 10k-token prefix.  Not a
        defence against deliberate forgery (the pool file is trusted to the same host
        anyway): it catches bugs and memory corruption.

        Returns an int64 tensor on the cache's device (on CUDA, queued on the load
        stream after the copies queued there).
        """
        self._check_ids(block_ids)
        if self.is_cpu:
            return self._digest(block_ids)
        with torch.cuda.stream(self._stream):
            return self._digest(block_ids)

    def _digest_weights(self) -> torch.Tensor:
        if not self.can_digest:
            raise ValueError("digests need a tile layout")
        if self._weights is None:
            w = torch.arange(self.block_bytes // 8, dtype=torch.int64, device=self.device)
            self._weights = (w * _DIGEST_MUL + _DIGEST_ADD) | 1
        return self._weights

    def _digest(self, block_ids: Sequence[int]) -> torch.Tensor:
        weights = self._digest_weights()
        idx = torch.tensor(list(block_ids), dtype=torch.long).to(self.device, non_blocking=True)
        total = torch.zeros(len(block_ids), dtype=torch.int64, device=self.device)
        for layer, off in zip(self.layers, self._offsets, strict=True):
            assert layer.raw is not None
            words = layer.raw.index_select(0, idx).view(torch.int64)
            w = weights[off // 8 : (off + layer.tile_bytes) // 8]
            total += (words * w).sum(dim=1)
        return total
