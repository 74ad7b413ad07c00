"""The layer-wise feed of same-host loads: their copies queued on CUDA layer by layer
(:class:`LayerFeed`), and the :class:`Transfer` each load waits on.

:meth:`~.kvio.KVBlockIO.copy_in_many` builds one feed for the loads it queues at once; a
forward pass waits on each layer's event (:meth:`Transfer.wait_layer`), which queues the
layers not yet queued.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import InitVar, dataclass
from typing import Any

import torch

from pegaflow.transport.gil_io import quick_handback

from . import tilecopy

logger = logging.getLogger("pegaflow.connector")


@dataclass
class Layer:
    name: str
    raw: torch.Tensor | None
    """(num_blocks, tile_bytes) uint8 view when blocks are contiguous tiles"""
    moved: torch.Tensor
    """the layer with the block dimension first (fallback path)"""
    tile_bytes: int
    split: int
    """kernel blocks per vLLM block (1 unless the backend splits blocks)"""


@dataclass(frozen=True)
class CopyIn:
    """One load of :meth:`KVBlockIO.copy_in_many`: block ``i`` from
    ``host[offsets[i]:][:block_bytes]`` into KV block ``block_ids[i]`` of every layer.

    ``host`` is a flat uint8 CPU tensor; ``mapped``: it is pinned and visible to the
    device; ``digest``: also compute each block's :meth:`KVBlockIO.digest`
    (``Transfer.digests``); ``piece``: ``host`` was pinned in pieces of this many bytes
    (0: whole), and a 2-D copy never spans two.
    """

    host: torch.Tensor
    offsets: Sequence[int]
    block_ids: Sequence[int]
    mapped: bool = False
    digest: bool = False
    piece: int = 0


class Refused2D(Exception):
    """The driver refused a 2-D copy (``copy_in_many`` then falls back to the kernel)."""


def _timing_event(stream: Any) -> Any:
    """A timing event recorded on ``stream`` now."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


class LayerFeed:
    """The copies of one :meth:`KVBlockIO.copy_in_many` call on CUDA, queued layer by
    layer: the staging-buffer loads first (all layers at once), then per layer every
    other load's tiles (2-D copies or the tile kernel), an event, and the 2-D loads'
    digest kernels behind it on the check stream.  The first ``ahead`` layers (all of
    them when 0) are queued on construction, the others by :meth:`to`."""

    def __init__(
        self,
        io: Any,  # the KVBlockIO whose streams and layers it uses
        loads: Sequence[CopyIn],
        ways: list[tuple[str, list[tuple[int, int, int]]]],
        ahead: int,
    ) -> None:
        self.io = io
        self.loads = loads
        self.ways = ways
        self.ahead = max(0, ahead)
        self.layers = len(io.layers)
        self.events: list[Any] = []
        """one per layer queued so far, after that layer's copies of every load"""
        self.tail: Any = None
        """after the digest kernels of the last layer (2-D loads with digests)"""
        self.failed: set[int] = set()
        """loads whose later layers could not be queued (their blocks are misses)"""
        self.sums: list[torch.Tensor | None] = [None] * len(loads)
        self._ids: list[dict[int, torch.Tensor]] = [{} for _ in loads]
        self._srcs: list[tuple[Any, torch.Tensor]] = [(None, torch.empty(0))] * len(loads)
        self._checked = False
        self._lock = threading.Lock()
        self.spans: list[tuple[Any, Any]] = []
        """timing events around each batch of layers queued: the copies' busy time on
        the device, without the gaps while the forward pass had not asked for more"""
        begin = _timing_event(io._stream)
        with torch.cuda.stream(io._stream):
            self._start()
        self._queue(self.ahead or self.layers, first=True, begin=begin)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "PegaFlow: %d loads queued layer-major%s: %s",
                len(loads),
                f" ({self.ahead} layers ahead)" if self.ahead else "",
                ", ".join(
                    f"{len(ld.block_ids)} blocks by {way}" + (f", {len(runs)} runs" if runs else "")
                    for ld, (way, runs) in zip(loads, ways, strict=True)
                ),
            )

    def _start(self) -> None:
        io = self.io
        for j, (ld, (way, _)) in enumerate(zip(self.loads, self.ways, strict=True)):
            if way == "none":
                continue
            if way == "dma":
                io._copy_in_dma(ld.host, ld.offsets, ld.block_ids)
                self.sums[j] = io._digest(ld.block_ids) if ld.digest else None
                continue
            self._ids[j] = io._tile_offsets(ld.block_ids)
            if ld.digest:
                self.sums[j] = torch.zeros(len(ld.block_ids), dtype=torch.int64, device=io.device)
            if way == "kernel":
                self._srcs[j] = (
                    tilecopy.RawPointer(ld.host.data_ptr()),
                    tilecopy.offsets_tensor(ld.offsets, io.device),
                )
            elif ld.digest:
                self._checked = True
                for t in (self.sums[j], *self._ids[j].values()):
                    assert t is not None
                    t.record_stream(io._check_stream)

    @property
    def done(self) -> bool:
        """Whether every layer is queued."""
        return len(self.events) == self.layers

    def to(self, n: int) -> None:
        """Queue the layers before ``n`` not queued yet (thread-safe)."""
        if len(self.events) < min(n, self.layers):  # the forward pass's usual case: none
            with quick_handback():
                self._queue(n)

    def _queue(self, n: int, first: bool = False, begin: Any = None) -> None:
        io = self.io
        with self._lock, torch.cuda.stream(io._stream):
            if len(self.events) >= min(n, self.layers):
                return
            begin = begin or _timing_event(io._stream)
            for k in range(len(self.events), min(n, self.layers)):
                layer, off = io.layers[k], io._offsets[k]
                for j, (ld, (way, runs)) in enumerate(zip(self.loads, self.ways, strict=True)):
                    if j in self.failed:
                        continue
                    try:
                        self._copy_layer(layer, off, ld, way, runs, self._srcs[j], self._ids[j], j)
                    except Refused2D as e:
                        if first:
                            raise  # copy_in_many redoes every load by the kernel
                        self.failed.add(j)  # its earlier layers went by 2-D copies
                        io._dma2d_ok = False
                        logger.warning("PegaFlow: a 2-D copy failed mid-load (%s): a miss", e)
                ev = torch.cuda.Event()
                ev.record(io._stream)
                self.events.append(ev)
                if self._checked:
                    self._check_layer(layer, off, ev)
            self.spans.append((begin, _timing_event(io._stream)))
            if self.done and self._checked:
                self.tail = torch.cuda.Event()
                self.tail.record(io._check_stream)

    def busy_ms(self) -> float | None:
        """The copies' time on the device, once every layer is done: the sum of the
        spans, so that a forward pass that asked for its layers late does not count."""
        if not self.finished():
            return None
        return float(sum(b.elapsed_time(e) for b, e in self.spans))

    def finished(self) -> bool:
        """Whether every layer is queued and its copies are done on the device."""
        return self.done and bool(self.spans[-1][1].query())

    def _copy_layer(
        self, layer: Layer, off: int, ld: CopyIn, way: str, runs: list[tuple[int, int, int]],
        src: tuple[Any, torch.Tensor], ids: dict[int, torch.Tensor], j: int,
    ) -> None:  # fmt: skip
        assert layer.raw is not None
        tb = layer.tile_bytes
        if way == "2d":
            dst0, base = layer.raw.data_ptr(), ld.host.data_ptr()
            handle = self.io._stream.cuda_stream
            for i, m, pitch in runs:
                try:
                    tilecopy.copy_2d(
                        dst0 + ld.block_ids[i] * tb, tb, base + ld.offsets[i] + off,
                        pitch or tb, tb, m, handle,
                    )  # fmt: skip
                except RuntimeError as e:
                    raise Refused2D(str(e)) from e
        elif way == "kernel":
            tilecopy.copy_tiles(
                src[0], src[1], layer.raw, ids[tb], tb,
                self.io._digest_args(off, tb, self.sums[j]), src_shift=off,
            )  # fmt: skip

    def _check_layer(self, layer: Layer, off: int, ev: Any) -> None:
        io = self.io
        assert layer.raw is not None
        tb = layer.tile_bytes
        with torch.cuda.stream(io._check_stream):
            io._check_stream.wait_event(ev)
            for j, (ld, (way, _)) in enumerate(zip(self.loads, self.ways, strict=True)):
                if way == "2d" and ld.digest and j not in self.failed:
                    tilecopy.copy_tiles(
                        layer.raw, self._ids[j][tb], layer.raw, self._ids[j][tb], tb,
                        io._digest_args(off, tb, self.sums[j]), store=False,
                    )  # fmt: skip


@dataclass(eq=False, repr=False)
class Transfer:
    """One load's copies (of a :class:`LayerFeed`, shared by the loads queued with
    it; none on the CPU, where they are done), and the digests of the copied blocks
    when they were asked for (done with the last layer's event, or the feed's tail)."""

    digests: torch.Tensor | None = None
    feed: InitVar[LayerFeed | None] = None
    index: InitVar[int] = 0
    checked: InitVar[bool] = False

    def __post_init__(self, feed: LayerFeed | None, index: int, checked: bool) -> None:
        self._feed = feed
        self._index = index
        self._checked = checked
        """whether digest kernels run behind the copies (the feed's tail ends them)"""

    @property
    def events(self) -> list[Any]:
        """The completion event of each layer queued so far (shared by the feed's loads)."""
        return [] if self._feed is None else self._feed.events

    @property
    def failed(self) -> bool:
        """Whether part of the copies could not be queued (every block is a miss)."""
        return self._feed is not None and self._index in self._feed.failed

    def device_ms(self) -> float | None:
        """From the first copy to the last on the device (once done), gaps included."""
        f = self._feed
        if f is None or not f.finished():
            return None
        return float(f.spans[0][0].elapsed_time(f.spans[-1][1]))

    def busy_s(self) -> float | None:
        """This load's share, by its blocks, of the time its feed's copies kept the
        device busy (:meth:`LayerFeed.busy_ms`), once done; None on the CPU."""
        f = self._feed
        busy = None if f is None else f.busy_ms()
        if f is None or busy is None:
            return None
        total = sum(len(ld.block_ids) for ld in f.loads)
        return busy / 1e3 * len(f.loads[self._index].block_ids) / max(1, total)

    def wait_layer(self, i: int) -> None:
        """Make the current stream wait (on the device, not the CPU) for layer ``i``
        (-1: the last), queuing it first if it is not yet, with the feed's ``ahead``
        layers after it; at the last layer, for the digests too (the step's work then
        follows every read of its blocks, even when its checks are read later)."""
        f = self._feed
        if f is None:
            return
        k = f.layers - 1 if i < 0 else i
        f.to(k + 1 + f.ahead if f.ahead else f.layers)
        with quick_handback():
            torch.cuda.current_stream().wait_event(f.events[k])
            if self._checked and k == f.layers - 1:
                torch.cuda.current_stream().wait_event(f.tail)

    def wait_all(self) -> None:
        """Make the current stream wait for every layer (and the digests)."""
        self.wait_layer(-1)

    def synchronize(self) -> None:
        """Queue what is left and block the calling thread until every copy is done."""
        f = self._feed
        if f is None:
            return
        f.to(f.layers)
        f.events[-1].synchronize()
        if self._checked:
            f.tail.synchronize()
