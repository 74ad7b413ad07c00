"""The test helpers' kill of a process group also removes its shared-memory segments."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.support.vllm_engine import kill_group

CHILD = """
from multiprocessing import shared_memory, resource_tracker
import sys, time
shm = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(shm._name, "shared_memory")  # as vLLM's killed processes leave it
print(shm.name, flush=True)
time.sleep(600)
"""


def test_a_killed_groups_shared_memory_is_removed() -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert p.stdout is not None
    name = p.stdout.readline().strip().lstrip("/")
    path = f"/dev/shm/{name}"
    assert name.startswith("psm_") and os.path.exists(path)
    time.sleep(0.2)  # mapped before the kill
    kill_group(p)
    assert not os.path.exists(path)
