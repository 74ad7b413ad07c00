"""Smoke test of the fault suite (``scripts/chaos.py``): a short run with a fixed seed
against real processes (etcd, coordinators, nodes, client workers), judged on its JSON.

The stall bound (no client call returns 1 s or more past its deadline) is checked only
with ``PEGAFLOW_CHAOS_STRICT=1``: a SIGSTOPped node over UCX's TCP transport still
freezes the clients' event loops (issue 11, item 1) while that is being fixed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pegaflow.devcluster import ETCD_BINARY

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "chaos.py"
STRICT = os.environ.get("PEGAFLOW_CHAOS_STRICT") == "1"


def run_chaos(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], Any]:
    """Run the script to its end; returns the process and its report (last stdout line)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no report (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc, json.loads(lines[-1])


def _left_over(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"pegaflow" in cmdline or b"etcd" in cmdline or b"chaos" in cmdline


@pytest.mark.skipif(shutil.which(ETCD_BINARY) is None, reason="no etcd binary")
def test_chaos_run_serves_no_wrong_bytes_and_cleans_up() -> None:
    # 36 s of load over UCX's TCP transport, faults on nodes, coordinators, etcd and
    # clients for the first 27 s (seed 11 reaches each kind of target)
    proc, report = run_chaos("--minutes", "0.6", "--seed", "11", "--tls", "tcp", timeout=240)
    assert proc.returncode in (0, 1), proc.stderr[-4000:]  # 2: no cluster, 130: interrupted
    assert report["wrong_bytes"] == 0, report["bad_events"]
    assert report["late_writes"] == 0, report["bad_events"]
    assert report["ops"].get("put", 0) > 0 and report["ops"].get("lookup", 0) > 0, report
    assert report["blocks"].get("get_ok", 0) > 0, report
    assert {f["target"][0] for f in report["faults"]} >= {"n", "c"}, report["faults"]
    assert not [k for k in report["errors"] if ":untyped" in k], report["errors"]
    # every process and directory of the run is gone
    assert not [p for p in report["pids"] if _left_over(p)]
    assert not [d for d in report["dirs"] if Path(d).exists()]
    if STRICT:
        assert report["max_stall_ms"] < 1000, report["worst_stalls"]
        assert proc.returncode == 0, report["failed"]
