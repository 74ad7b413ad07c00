"""The pure parts of :mod:`pegaflow.connector.media.tilecopy` (its copies run on the GPU:
tests/integration/test_gpu_path.py)."""

from __future__ import annotations

import io
from typing import Any

import pytest
from pegaflow.connector.media import tilecopy


def test_the_2d_copy_keeping_the_gil_comes_from_torchs_libcudart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Of the libcudarts mapped in this process the one of torch's CUDA major version
    is loaded through ``ctypes.PyDLL``; none mapped (a CPU host): False, and the copies
    use cuda-python's binding."""
    maps = (
        "7f00-7f01 r-xp 0 08:01 1 /opt/cuda-python/lib/libcudart.so.12\n"
        "7f02-7f03 r-xp 0 08:01 2 /opt/torch/nvidia/cu13/lib/libcudart.so.13\n"
    )
    loaded: list[str] = []

    class Lib:
        def __init__(self, path: str) -> None:
            loaded.append(path)
            self.cudaMemcpy2DAsync = lambda *a: 0
            self.cudaGetLastError = lambda: 0

    real_open = open

    def fake_open(path: Any, *a: Any, **k: Any) -> Any:
        return io.StringIO(maps) if path == "/proc/self/maps" else real_open(path, *a, **k)

    monkeypatch.setattr(tilecopy.torch.version, "cuda", "13.0")
    monkeypatch.setattr(tilecopy.ctypes, "PyDLL", Lib)
    monkeypatch.setattr("builtins.open", fake_open)
    got = tilecopy._find_memcpy_2d()
    assert got and loaded == ["/opt/torch/nvidia/cu13/lib/libcudart.so.13"]
    maps = "7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n"
    assert tilecopy._find_memcpy_2d() is False
