"""A storage node's pool file, mapped into this process (the same-host shortcut).

When the connector's node runs on its own host, the node offers its pool file in the
data-plane handshake (path plus device and inode numbers).  The connector maps it and
copies blocks straight between the file's pages and the KV cache: no UCX hop and no
staging copy.  The node still owns the pool: reads go through ``locate`` (which pins
the blocks while they are copied) and writes through a local ``reserve`` / ``commit``
(the node checks every written slot's xxh3 before publishing it).

On a CUDA device the mapping is registered with the driver (``cudaHostRegister``,
portable and mapped), so the copy engines DMA at full speed and GPU kernels can read
and write the file's pages directly.  Registration pins every page of the pool; it runs
in a background thread so that engine start is not delayed, and until it finishes the
mapping is used like any pageable memory.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from typing import Any

import numpy as np
import torch
from pegaflow.client.samehost import PoolFile, open_pool_file

log = logging.getLogger("pegaflow.connector")

_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02
_REGISTER_CHUNK = 1 << 30
"""pinned a piece at a time: each call holds the CUDA driver's lock, which the engine's
own start-up needs too (a multiple of the node's slab size: no block spans two pieces)"""


class MappedPool:
    """The node's pool file mapped read-write, as a flat uint8 CPU tensor.

    Raises ``OSError`` when the file is not the one the node described (another host's
    path, a replaced file) or cannot be opened by this process.
    """

    def __init__(self, info: PoolFile, device: torch.device | None = None) -> None:
        fd = open_pool_file(info)
        try:
            self._mmap = mmap.mmap(fd, info.size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.info = info
        self.size = info.size
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.array)
        self.ptr = int(self.array.ctypes.data)
        self._registered = False
        self._pieces: list[int] = []
        self.piece = _REGISTER_CHUNK
        """the pool is pinned in pieces of this many bytes (one registration each)"""
        self._register_thread: threading.Thread | None = None
        self.register_seconds = 0.0
        if device is not None and device.type == "cuda":
            self._register_thread = threading.Thread(
                target=self._register, args=(device,), name="pegaflow-pool-register", daemon=True
            )
            self._register_thread.start()

    def _register(self, device: torch.device) -> None:
        t0 = time.monotonic()
        try:
            cudart = torch.cuda.cudart()
            done: list[int] = []
            with torch.cuda.device(device):
                for off in range(0, self.size, _REGISTER_CHUNK):
                    n = min(_REGISTER_CHUNK, self.size - off)
                    err = cudart.cudaHostRegister(self.ptr + off, n, _REGISTER_PORTABLE_MAPPED)
                    code = int(getattr(err, "value", err))
                    if code != 0:
                        for d in done:
                            cudart.cudaHostUnregister(self.ptr + d)
                        log.warning(
                            "PegaFlow: cudaHostRegister of the node's pool failed (error %d); "
                            "copies from it run at pageable-memory speed",
                            code,
                        )
                        return
                    done.append(off)
                    time.sleep(0)  # let the engine's own CUDA calls in between
            self._pieces = done
            self._registered = True
            self.register_seconds = time.monotonic() - t0
            log.info(
                "PegaFlow: node pool %s (%.1f GiB) pinned for DMA in %.2f s",
                self.info.path,
                self.size / 2**30,
                self.register_seconds,
            )
        except Exception as e:  # no CUDA runtime, or registration not allowed
            log.warning("PegaFlow: cannot pin the node's pool for DMA: %s", e)

    @property
    def registered(self) -> bool:
        """Whether the mapping is pinned and visible to the device (DMA and kernels)."""
        return self._registered

    def wait_registered(self, timeout: float | None = None) -> bool:
        """Wait for the background registration; returns :attr:`registered`."""
        if self._register_thread is not None:
            self._register_thread.join(timeout)
        return self._registered

    def view(self, offset: int, size: int) -> np.ndarray:
        """Bytes ``[offset, offset + size)`` of the pool (no copy)."""
        if offset < 0 or size < 0 or offset + size > self.size:
            raise IndexError(f"pool range {offset}+{size} outside {self.size} bytes")
        return self.array[offset : offset + size]

    def close(self) -> None:
        """Unregister and unmap (the caller makes sure no copy still uses the pool)."""
        if self._register_thread is not None:
            self._register_thread.join()
        if self._registered:
            try:
                for off in self._pieces:
                    torch.cuda.cudart().cudaHostUnregister(self.ptr + off)
            except Exception:
                pass
            self._registered = False
        self.tensor = None  # type: ignore[assignment]
        self.array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process

    def __enter__(self) -> MappedPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
