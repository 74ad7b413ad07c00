"""One GPU kernel that copies many equal-size tiles between two address spaces.

The copy engines move large extents at full PCIe speed, but the pieces of a KV cache
are small (one layer of one 16-token block of Llama-3.1-8B is 64 KiB) and thousands of
small DMAs run at a fraction of it.  This kernel instead has the GPU's SMs read (or
write) the tiles themselves, through the host memory's mapping into the device address
space (pinned or ``cudaHostRegister``-ed memory under unified addressing): one launch
per layer moves every block of a request, and a layer can be waited for on its own
(layer-wise loading).

Sources and destinations are raw device-visible addresses plus per-tile byte offsets,
so the same kernel serves host pool -> KV cache (loads) and KV cache -> host (saves).
Triton is optional: :func:`available` says whether the kernel can run here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

try:  # triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

_ELEM = 8
"""bytes per element moved (tiles and offsets must be multiples of it)"""
_BLOCK = 1024
"""elements per program: 8 KiB"""
_WARPS = 4
"""warps per program"""


class RawPointer:
    """A device-visible address that Triton accepts as a pointer argument."""

    def __init__(self, ptr: int, dtype: torch.dtype = torch.int64) -> None:
        self.ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.ptr


if triton is not None:

    @triton.jit
    def _copy_tiles_kernel(
        src,
        src_off,
        src_shift,
        dst,
        dst_off,
        dst_shift,
        tile_elems,
        wts,
        dig,
        BLOCK: tl.constexpr,
        DIGEST: tl.constexpr,
        STORE: tl.constexpr,
    ):
        t = tl.program_id(0)
        c = tl.program_id(1)
        # offsets are multiples of 16 bytes: lets the compiler use 128-bit accesses
        s0 = tl.multiple_of(tl.load(src_off + t) + src_shift, 2)
        d0 = tl.multiple_of(tl.load(dst_off + t) + dst_shift, 2)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < tile_elems
        v = tl.load(src + s0 + offs, mask=mask, other=0)
        if STORE:
            tl.store(dst + d0 + offs, v, mask=mask)
        if DIGEST:  # the words just stored, position-weighted, summed modulo 2**64
            w = tl.load(wts + offs, mask=mask, other=0)
            tl.atomic_add(dig + t, tl.sum(v * w, axis=0))


def available(device: torch.device) -> bool:
    """Whether the tile kernel can run on ``device``."""
    return triton is not None and device.type == "cuda"


def aligned(*values: int) -> bool:
    """Whether addresses, offsets and sizes suit the kernel (16-byte multiples)."""
    return all(v % 16 == 0 for v in values)


def copy_tiles(
    src: Any,
    src_offsets: torch.Tensor,
    dst: Any,
    dst_offsets: torch.Tensor,
    tile_bytes: int,
    digest: tuple[torch.Tensor, torch.Tensor] | None = None,
    src_shift: int = 0,
    dst_shift: int = 0,
    store: bool = True,
) -> None:
    """Copy ``len(src_offsets)`` tiles of ``tile_bytes``: ``src + src_offsets[i] +
    src_shift`` to ``dst + dst_offsets[i] + dst_shift``, on the current CUDA stream.

    ``src``/``dst``: CUDA tensors or :class:`RawPointer` (any device-visible address);
    offsets: int64 CUDA tensors of *byte* offsets (in elements of 8 bytes: see
    :func:`offsets_tensor`), shifts in bytes; all multiples of 16.
    ``digest``: ``(weights, sums)``, int64 CUDA tensors: ``sums[i]`` is increased by the
    sum over the tile's 64-bit words ``j`` of ``word[j] * weights[j]`` (modulo 2**64),
    computed from the words as they are stored, so a caller gets each block's digest
    without reading the blocks again.  ``store=False``: only the digests (the tiles at
    ``src`` are read, nothing is written).
    """
    n = int(src_offsets.numel())
    if n == 0:
        return
    if triton is None:
        raise RuntimeError("triton is not installed")
    elems = tile_bytes // _ELEM
    grid = (n, triton.cdiv(elems, _BLOCK))
    wts, sums = digest if digest is not None else (src_offsets, src_offsets)
    _copy_tiles_kernel[grid](
        _as_i64(src),
        src_offsets,
        src_shift // _ELEM,
        _as_i64(dst),
        dst_offsets,
        dst_shift // _ELEM,
        elems,
        wts,
        sums,
        BLOCK=_BLOCK,
        DIGEST=digest is not None,
        STORE=store,
        num_warps=_WARPS,
    )


def _as_i64(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.view(torch.uint8).view(torch.int64) if x.dtype != torch.int64 else x
    return x


def offsets_tensor(values: Sequence[int], device: torch.device, scale: int = 1) -> torch.Tensor:
    """Byte offsets ``values[i] * scale`` (multiples of 8) as the int64 tensor of element
    offsets :func:`copy_tiles` takes, on ``device`` (one small host-to-device copy)."""
    arr = np.asarray(values, dtype=np.int64) * scale // _ELEM
    return torch.from_numpy(arr).to(device, non_blocking=True)


try:  # the CUDA runtime's 2-D copy, for copy-engine loads of whole runs of tiles
    from cuda.bindings import runtime as _cudart
except Exception:  # pragma: no cover - CPU installs, or an older cuda-python
    _cudart = None

_H2D = 1
"""``cudaMemcpyHostToDevice``"""
_memcpy_2d: Any = None
"""``cudaMemcpy2DAsync`` and ``cudaGetLastError`` of the libcudart torch loaded, through
:class:`ctypes.PyDLL` (found at the first copy; False where they cannot be)"""


def _find_memcpy_2d() -> Any:
    """``(cudaMemcpy2DAsync, cudaGetLastError)`` of the process's own libcudart, called
    without releasing the GIL: a layer-wise load makes about a hundred such calls, and
    each release costs the engine's thread up to a switch interval beside a busy thread
    (:mod:`pegaflow.transport.gil_io`); the call itself only queues the copy.  False where no
    libcudart is mapped (Linux's ``/proc/self/maps``) or it lacks the symbol:
    cuda-python's binding is used then."""
    major = (torch.version.cuda or "").split(".")[0]
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/libcudart.so" in line]
        # torch's runtime where another one is mapped too (cuda-python may load its own)
        path = next((p for p in paths if f"/libcudart.so.{major}" in p), paths[0])
        lib = ctypes.PyDLL(path)
        fn, last_error = lib.cudaMemcpy2DAsync, lib.cudaGetLastError
    except (OSError, IndexError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    fn.argtypes += [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = last_error.restype = ctypes.c_int
    return fn, last_error


def dma2d_available() -> bool:
    """Whether :func:`copy_2d` can run here (cuda-python present)."""
    return _cudart is not None


def copy_2d(
    dst: int, dpitch: int, src: int, spitch: int, width: int, rows: int, stream: int
) -> None:
    """Queue one 2-D host-to-device copy on ``stream`` (a raw CUDA stream handle):
    ``rows`` rows of ``width`` bytes, ``spitch`` apart at ``src``, ``dpitch`` apart at
    ``dst``.  The copy engines move such rows at full PCIe speed when they are large
    (a layer of a KV block is tens of KiB), where one copy per tile would not."""
    global _memcpy_2d
    assert _cudart is not None
    if _memcpy_2d is None:
        _memcpy_2d = _find_memcpy_2d()
    if _memcpy_2d:
        memcpy_2d, last_error = _memcpy_2d
        code = memcpy_2d(dst, dpitch, src, spitch, width, rows, _H2D, stream)
        ok = code == 0
        if not ok:
            last_error()  # torch shares this runtime: its next launch check must not see it
    else:
        (err,) = _cudart.cudaMemcpy2DAsync(
            dst, dpitch, src, spitch, width, rows,
            _cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, stream,
        )  # fmt: skip
        code, ok = err, err == _cudart.cudaError_t.cudaSuccess
    if not ok:
        raise RuntimeError(
            f"cudaMemcpy2DAsync(dst={dst:#x}, dpitch={dpitch}, src={src:#x}, spitch={spitch},"
            f" width={width}, rows={rows}) failed: {code}"
        )
