"""A node journal's frames, the old v1 format, and a size-limited tmpfs to fill."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from pegaflow.storage_node.pool import Entry

KiB, MiB = 1 << 10, 1 << 20
POOL, SLAB = MiB, 256 * KiB
# Version 2 framing, as the journal's module docstring specifies it.
HEAD = struct.Struct("<2sHI")


@contextlib.contextmanager
def tmpfs(size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted on a fresh directory, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = Path(tempfile.mkdtemp(prefix="pegaflow-tmpfs-"))
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield d
    finally:
        if subprocess.run(["umount", str(d)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(d)], capture_output=True, timeout=30)
        with contextlib.suppress(OSError):
            d.rmdir()


def fill(d: Path, leave: int) -> Path:
    """Fill the file system of ``d`` up to ``leave`` free bytes with one file."""
    st = os.statvfs(d)
    free = st.f_bavail * st.f_frsize
    filler = d / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return HEAD.pack(b"PJ", len(body), zlib.crc32(body)) + body


def unframe(data: bytes) -> list[Any]:
    objs, pos = [], 0
    while pos < len(data):
        magic, n, crc = HEAD.unpack_from(data, pos)
        body = data[pos + HEAD.size : pos + HEAD.size + n]
        assert magic == b"PJ" and zlib.crc32(body) == crc
        objs.append(msgpack.unpackb(body, raw=False))
        pos += HEAD.size + n
    return objs


def pack_v1(objs: list[Any]) -> bytes:
    return b"".join(msgpack.packb(o, use_bin_type=True) for o in objs)


def unpack_v1(data: bytes) -> list[Any]:
    u = msgpack.Unpacker(raw=False)
    u.feed(data)
    return list(u)


def v1_journal(entries: list[Entry], pool: int = POOL, slab: int = SLAB) -> bytes:
    """A version-1 journal (PegaFlow 0.1.0: bare msgpack records) of ``entries``."""
    objs: list[Any] = [["pegaflow-journal", 1, pool, slab]]
    objs += [["C", e.offset, e.stride, e.size, e.gen, e.xxh3, *e.key] for e in entries]
    return pack_v1(objs)
