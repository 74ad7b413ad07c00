"""Pure logic of ``scripts/trace_summary.py``: ``--compare`` on a small made-up trace
(a restarted engine's first step against a later one), written and read back as vLLM's
profiler writes it (gzipped Chrome trace JSON)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.script_module import SCRIPTS, load_script


def _ev(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _trace() -> list[dict[str, Any]]:
    """Two steps: the first 30 ms with a slow first copy and a long launch, the second
    10 ms; GPU work queued in each."""
    return [
        _ev("user_annotation", "execute_context_1(16)_generation_0(0)", 0, 30_000),
        _ev("python_function", "kvio.py(120): first_copy", 1_000, 12_000),
        _ev("cuda_runtime", "cudaLaunchKernel", 14_000, 5_000),
        _ev("kernel", "copy_tiles", 20_000, 8_000, tid=7),
        _ev("user_annotation", "execute_context_1(16)_generation_0(0)", 100_000, 10_000),
        _ev("cuda_runtime", "cudaLaunchKernel", 101_000, 1_000),
        _ev("kernel", "copy_tiles", 102_000, 6_000, tid=7),
        {"ph": "i", "name": "an instant event: not counted", "ts": 5, "pid": 1, "tid": 1},
    ]


def test_compare_names_what_the_first_step_spent_more_on(tmp_path: Path) -> None:
    ts = load_script("trace_summary")
    path = tmp_path / "worker.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    got = ts.compare(ts.load(path), 0, -1)
    assert got["steps_ms"] == [30.0, 10.0]
    assert got["compared"] == [0, -1]
    top = got["more_in_a"][:2]
    assert top[0] == ["python_function: kvio.py(120): first_copy", 12.0, 1, 0]
    assert top[1] == ["cuda_runtime: cudaLaunchKernel", 4.0, 1, 1]
    assert got["gpu_ms"] == [{"kernel/stream 7": 8.0}, {"kernel/stream 7": 6.0}]

    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "trace_summary.py"), str(path), "--compare", "0", "1"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(run.stdout.strip().splitlines()[-1])["more_in_a"][0][1] == 12.0
    assert "+12.00 ms  python_function: kvio.py(120): first_copy (1 vs 0 events)" in run.stdout
