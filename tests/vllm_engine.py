"""Test helper: a real vLLM engine process (``tests/vllm_runner.py``) to send commands to."""

from __future__ import annotations

import glob
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TINY_MODEL = str(HERE / "assets" / "tiny-llama")


class VllmEngine:
    """One engine process; :meth:`generate` / :meth:`ttft` block until it answers."""

    def __init__(
        self,
        spec: dict[str, Any],
        env: dict[str, str] | None = None,
        name: str = "engine",
        start_timeout: float = 300.0,
    ) -> None:
        self.name = name
        self.spec = {"model": TINY_MODEL, **spec}
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log: list[str] = []
        self._results: queue.Queue[str] = queue.Queue()
        self.popen = subprocess.Popen(
            [sys.executable, str(HERE / "vllm_runner.py"), json.dumps(self.spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            cwd=REPO,
            start_new_session=True,  # its own process group: EngineCore and workers die with it
        )
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + start_timeout
        while not self._ready.wait(0.2):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{name} did not start:\n" + self.tail())

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            line = line.rstrip("\n")
            if line == "READY":
                self._ready.set()
            elif line.startswith("RESULT "):
                self._results.put(line[len("RESULT ") :])
            else:
                self.log.append(line)
                if len(self.log) > 5000:
                    del self.log[:2500]
        self._results.put("")

    def tail(self, n: int = 60) -> str:
        """The end of the engine's output."""
        return "\n".join(self.log[-n:])

    def call(self, cmd: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        """Send one command, return its answer."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(cmd) + "\n")
        self.popen.stdin.flush()
        try:
            line = self._results.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name}: no answer in {timeout} s:\n{self.tail()}") from None
        if not line:
            raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
        res = json.loads(line)
        if "error" in res:
            raise RuntimeError(f"{self.name}: {res['error']}\n{self.tail()}")
        return res

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> dict[str, Any]:
        """Greedy outputs and per-request cached-token counts of one batch."""
        return self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})

    def ttft(self, prompts: list[list[int]]) -> dict[str, Any]:
        """Per-prompt time to first token, one prompt at a time."""
        return self.call({"op": "ttft", "prompts": prompts})

    def stop(self, timeout: float = 60.0) -> None:
        """Quit gracefully (the connector drains its saves, vLLM frees its shared
        memory), else kill."""
        if self.popen.poll() is None:
            try:
                assert self.popen.stdin is not None
                self.popen.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.popen.stdin.flush()
                self.popen.wait(timeout)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # let EngineCore and workers exit on their own
            try:
                os.killpg(self.popen.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.2)
        self.kill()  # leftovers of the group, if any

    def kill(self) -> None:
        """SIGKILL the engine and every process it started (EngineCore, workers)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(30)


def prompts(
    n: int, length: int, seed: int = 0, vocab: int = 1000, prefix: list[int] | None = None
) -> list[list[int]]:
    """``n`` deterministic token-id prompts of ``length`` tokens (after ``prefix``)."""
    import random

    rng = random.Random(seed)
    pre = list(prefix or [])
    return [pre + [rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def connector_stats(prefix: str) -> dict[str, float]:
    """Cumulative connector counters of an engine (scheduler + all workers), from the
    JSON files the connector writes when ``stats_path`` is set."""
    out: dict[str, float] = {}
    for path in glob.glob(f"{prefix}.*.json"):
        try:
            with open(path) as fh:
                for k, v in json.load(fh).items():
                    out[k] = out.get(k, 0) + v
        except (OSError, ValueError):
            pass
    return out


def wait_saved(prefix: str, blocks: int, timeout: float = 120.0) -> dict[str, float]:
    """Wait until an engine's connector saved (or found present) ``blocks`` blocks."""
    deadline = time.monotonic() + timeout
    while True:
        s = connector_stats(prefix)
        done = s.get("save_blocks", 0) + s.get("save_present_blocks", 0)
        if done >= blocks or time.monotonic() > deadline:
            return s
        time.sleep(0.2)
