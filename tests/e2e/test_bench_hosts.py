"""``scripts/bench_hosts.py`` at a tiny size, for real: two namespace hosts, a
``pegaflow-server`` on one, the client, the TCP stream and ``ucx_perftest`` across the
bridge; the last line is the JSON the docs quote.  Needs root (``ip netns``)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.support.netns_hosts import available
from tests.support.script_module import SCRIPTS

pytestmark = pytest.mark.ucx

BENCH = str(SCRIPTS / "bench_hosts.py")
TINY = ["--rounds", "1", "--block", "256KiB", "--batch", "4", "--tcp-message", "1MiB"]

_why = available()
needs_hosts = pytest.mark.skipif(_why is not None, reason=str(_why))


def _run(args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess[str], Any]:
    p = subprocess.run(
        [sys.executable, BENCH, *args], capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p, json.loads(p.stdout.strip().splitlines()[-1])


def test_help_and_bad_arguments() -> None:
    p = subprocess.run([sys.executable, BENCH, "--help"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    for flag in ("--skip-ttft", "--rounds", "--block", "--batch", "--tcp-message"):
        assert flag in p.stdout
    p = subprocess.run([sys.executable, BENCH, "--rounds", "0"], capture_output=True, text=True)
    assert p.returncode == 2 and "--rounds" in p.stderr


@needs_hosts
def test_a_tiny_data_path_run_prints_its_figures() -> None:
    _, out = _run([*TINY, "--pool", "256MiB", "--skip-ttft"], timeout=240)
    assert out["byte_exact"] is True
    assert out["block_bytes"] == 256 << 10 and out["batch"] == 4 and out["rounds"] == 1
    for k in ("get_gbps", "put_gbps", "tcp_stream_gbps"):
        assert out[k] > 0, out
    assert out["get_ratio"] == pytest.approx(out["get_gbps"] / out["tcp_stream_gbps"], abs=2e-3)
    assert out["put_ratio"] == pytest.approx(out["put_gbps"] / out["tcp_stream_gbps"], abs=2e-3)
    # ucx_perftest runs across the bridge too (or says why not)
    assert (out["ucx_perftest_gbps"] or 0) > 0 or out["ucx_perftest_error"], out
    assert len(out["loadavg_start"]) == len(out["loadavg_end"]) == 3
    assert "cold_ttft_ms" not in out


@needs_hosts
@pytest.mark.slow
@pytest.mark.vllm
def test_ttft_across_hosts() -> None:
    """Two real vLLM engines on h2, no node of their own host: the warm one loads every
    full block of the prompt across the bridge."""
    args = [*TINY, "--pool", "256MiB", "--no-perftest", "--ttft-pool", "512MiB"]
    _, out = _run([*args, "--ttft-lengths", "512", "--ttft-prompts", "1"], timeout=900)
    assert out["tokens"] == 528  # a partial last block (bench_vllm_ttft)
    assert out["warm_cached_tokens"] == [512], out
    assert len(out["cold_ms"]) == len(out["warm_ms"]) == 1
    assert out["cold_ttft_ms"] > 0 and out["warm_ttft_ms"] > 0
    assert out["warm_over_cold"] == pytest.approx(
        out["warm_ttft_ms"] / out["cold_ttft_ms"], abs=1e-3
    )
    assert out["ucx_perftest_gbps"] is None
