"""A stop signal during a pool's preparation (issue 40): a large pool takes minutes to
prepare (45-190 s for 64 GiB), and a SIGTERM meanwhile is honoured at the next chunk,
not once the whole pool is ready; the file it was making is left behind by no one."""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pegaflow.storage_node import shm_file

from pegaflow.tools.devcluster import REPO

POOL = "4GiB"
"""large enough that its preparation outlasts the signal's way (seconds), small enough
to fit; the stop comes after a chunk or two, so little of it is ever touched"""


def test_prepare_stops_before_its_next_chunk(tmp_path: Path) -> None:
    stop = threading.Event()
    path = tmp_path / "pegaflow-t.pool"
    chunks: list[int] = []
    real = shm_file._prefault

    def prefault(mm: mmap.mmap, off: int, n: int) -> bool:
        chunks.append(off)
        stop.set()  # the signal comes while the first chunk is prepared
        return real(mm, off, n)

    capacity = 4 * shm_file.PREPARE_CHUNK
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shm_file, "_prefault", prefault)
        mp.setattr(shm_file, "check_room", lambda *a: None)
        with pytest.raises(shm_file.PreparationStopped, match="25% done"):
            shm_file.open_pool(path, capacity, None, "--node-pool-bytes", stop)
    assert chunks == [0]
    assert not list(tmp_path.iterdir())


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="pegaflow-stop-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.ucx
def test_sigterm_while_the_pool_is_prepared_stops_the_node(shm_dir: Path) -> None:
    p = subprocess.Popen(
        [sys.executable, "-m", "pegaflow.storage_node.main", "--node-id", "stopping",
         "--node-ucx-port", "0", "--node-http-port", "-1", "--node-pool-bytes", POOL,
         "--node-shm-dir", str(shm_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    log: list[str] = []
    try:
        assert p.stdout is not None
        for line in p.stdout:
            log.append(line.rstrip())
            if "preparing pool" in line:
                p.send_signal(signal.SIGTERM)
                break
        log += p.stdout.read().splitlines()
        rc = p.wait(120)
    finally:
        p.kill()
        p.wait()
    text = "\n".join(log)
    assert rc == 1, text  # stopped while starting
    assert "stopped while preparing pool" in text, text
    assert "ready in" not in text and "READY" not in text, text
    assert not list(shm_dir.iterdir())
