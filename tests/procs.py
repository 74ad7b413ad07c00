"""Real PegaFlow processes for tests and benchmarks: start, wait for READY, stop, kill."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    """A service process whose first stdout line ``READY k=v ...`` announced its ports."""

    name: str
    popen: subprocess.Popen[str]
    ready: dict[str, str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not stop in ``timeout``."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL (a crash, as far as the rest of the cluster can tell)."""
        if self.alive():
            self.popen.kill()
        self.popen.wait(10)


def start(
    name: str, argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 60.0
) -> Proc:
    """Run ``python -m <argv>`` and wait for its READY line."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    popen = subprocess.Popen(
        [sys.executable, "-m", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=REPO,
    )
    proc = Proc(name, popen)
    got = threading.Event()

    def pump() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            proc.log.append(line.rstrip())
            if len(proc.log) > 2000:
                del proc.log[:1000]
            if line.startswith("READY") and not got.is_set():
                proc.ready = dict(re.findall(r"(\w+)=(\S+)", line))
                got.set()
        got.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not got.wait(0.1):
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{name} not ready in {timeout}s:\n" + "\n".join(proc.log[-50:]))
    if not proc.ready:
        proc.kill()
        raise RuntimeError(f"{name} exited before READY:\n" + "\n".join(proc.log[-50:]))
    return proc


def start_node(
    node_id: str,
    *,
    etcd: str | None = None,
    prefix: str = "/pegaflow/test",
    pool: str = "256MiB",
    slab: str = "16MiB",
    token: str | None = None,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Proc:
    """A ``pegaflow-node`` on free ports; ``ready['ucx']`` is its data address."""
    argv = [
        "pegaflow.storage_node.main",
        "--node-node-id", node_id,
        "--node-ucx-port", "0",
        "--node-http-port", "0",
        "--node-pool-bytes", pool,
        "--node-slab-bytes", slab,
        "--etcd-prefix", prefix,
        "--etcd-lease-ttl-s", "3",
        *extra,
    ]  # fmt: skip
    if etcd:
        argv += ["--etcd-endpoints", etcd]
    if token:
        argv += ["--security-token", token]
    return start(f"node {node_id}", argv, env=env)
