"""``scripts/bench_disk_tier.py`` at a small size: every step, the real node's included,
prints its JSON line as soon as it is done, and the last line holds them all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_disk_benchmark_prints_each_step_and_the_whole(tmp_path: Path) -> None:
    argv = [
        sys.executable, str(REPO / "scripts" / "bench_disk_tier.py"),
        "--gb", "0.03", "--rounds", "1", "--block-mib", "1", "--node-prefix-gb", "0.03",
        "--dir", str(tmp_path), "--step-timeout-s", "60",
    ]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    steps = {x["step"]: x for x in lines[:-1]}
    assert list(steps) == ["tier", "restart", "node_promote", "node_spills_effect"], lines
    assert not [s for s in steps.values() if "error" in s], steps
    node = steps["node_promote"]
    assert node["promoted_blocks"] == node["byte_exact_blocks"] == node["blocks"], node
    assert node["streamed_blocks"] > 0, node  # the get sent ahead of its later reads
    whole = lines[-1]
    assert whole["read_gbps"] > 0 and whole["recover_s"] >= 0
    assert whole["node"]["promote_s"] > 0 and whole["node"]["get_from_memory_gbps"] > 0
