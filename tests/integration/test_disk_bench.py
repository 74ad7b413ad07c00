"""``scripts/bench_disk_tier.py`` at a small size: every step, the real node's included,
prints its JSON line as soon as it is done, and the last line holds them all."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pegaflow.storage_node.disk_files import DiskIO

REPO = Path(__file__).resolve().parents[2]


def test_the_disk_benchmark_prints_each_step_and_the_whole(tmp_path: Path) -> None:
    argv = [
        sys.executable, str(REPO / "scripts" / "bench_disk_tier.py"),
        "--gb", "0.03", "--rounds", "1", "--block-mib", "1", "--node-prefix-gb", "0.03",
        "--dir", str(tmp_path), "--step-timeout-s", "60", "--locates", "50",
    ]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    steps = {x["step"]: x for x in lines[:-1]}
    assert list(steps) == [
        "tier", "restart", "node_saves_during_spills", "node_control_during_spills",
        "node_promote", "node_spills_effect", "node_restart_get",
    ], lines  # fmt: skip
    assert not [s for s in steps.values() if "error" in s], steps
    node = steps["node_promote"]
    assert node["promoted_blocks"] == node["byte_exact_blocks"] == node["blocks"], node
    assert node["streamed_blocks"] > 0, node  # the get sent ahead of its later reads
    saves = steps["node_saves_during_spills"]
    assert saves["save_gbps"] > 0 and saves["save_during_spills_gbps"] > 0, saves
    evicted = saves["spilled_during"] + saves["spill_drops_during"]
    # every block put into a full pool pushed one out (spill-ahead may finish writes of
    # the steps before it meanwhile)
    assert evicted >= saves["blocks"] * saves["rounds"], saves
    assert saves["spill_copies_during"] + saves["spill_ahead_during"] <= evicted, saves
    assert saves["save_ratio_paired_median"] > 0, saves
    control = steps["node_control_during_spills"]
    assert control["locates_during_saves"] >= control["locates"] > 0, control
    assert control["locates_during_spills"] >= control["locates"], control
    assert control["spilled_during"] > 0 and control["over_control_socket"], control
    assert 0 < control["locate_p50_ms"] <= control["locate_p99_ms"], control
    again = steps["node_restart_get"]
    assert again["disk_blocks"] == again["disk_slots"], again  # restarted with the tier full
    assert again["got_blocks"] == again["byte_exact_blocks"] == again["blocks"], again
    assert 0 < again["ready_s"] <= again["serving_s"], again
    assert again["get_to_raw_read"] > 0, again
    whole = lines[-1]
    assert whole["read_gbps"] > 0 and whole["recover_s"] >= 0
    assert whole["node"]["promote_s"] > 0 and whole["node"]["get_from_memory_gbps"] > 0
    assert whole["node"]["restart_get"]["get_gbps"] > 0


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_the_spill_queue_is_resident_from_open(tmp_path: Path) -> None:
    """The bench's saves into a full pool ran at about half speed on the first
    evictions after a start: each spill's copy into a fresh staging buffer faulted its
    pages in on the data loop.  The staging memory is resident once the tier opens."""
    from pegaflow.storage_node.disk_tier import DiskTier

    block, depth = 1 << 20, 64
    before = _rss_anon()
    tier = DiskTier(tmp_path, 4 * block, block, queue_depth=depth, preallocate=False)
    try:
        grown = _rss_anon() - before
    finally:
        tier.close()
    assert grown >= 0.9 * depth * block, f"{grown >> 20} MiB resident of {depth} MiB staging"


class _CountingIO(DiskIO):
    """Counts the payload reads (the index is read with os.pread, not through here)."""

    def __init__(self) -> None:
        self.reads = 0
        self.lock = threading.Lock()

    def preadv(self, fd: int, bufs: Sequence[Any], offset: int) -> int:
        with self.lock:
            self.reads += 1
        return super().preadv(fd, bufs, offset)


def test_a_read_after_a_restart_does_not_wait_for_the_whole_check(tmp_path: Path) -> None:
    """The bench's first get after a restart (one block) waited as long as the
    background check of every payload: the check queued all its reads ahead of it.
    Now it keeps few in flight, so a get's read goes after at most those."""
    from pegaflow.storage_node.disk_tier import DiskTier

    block, n = 64 << 10, 64
    kw: dict[str, Any] = {"read_threads": 1, "queue_depth": n, "preallocate": False}
    tier = DiskTier(tmp_path, n * block, block, **kw)
    tier.recover()
    for i in range(n):
        assert tier.spill(("ns", i.to_bytes(8, "little"), 0), i, bytes([i]) * block)
    assert tier.flush(30)
    tier.close()
    io = _CountingIO()
    tier = DiskTier(tmp_path, n * block, block, io=io, **kw)
    try:
        assert len(tier.recover()) == n  # records only: no payload read yet
        check = tier.scrub()
        out = bytearray(block)
        assert tier.read_into(("ns", (n - 1).to_bytes(8, "little"), 0), out).result(30) == block
        reads_before_ours = io.reads - 1
        assert bytes(out) == bytes([n - 1]) * block
        assert check.result(30) == []
    finally:
        tier.close()
    assert reads_before_ours < n // 4, f"{reads_before_ours} of the check's {n} reads went first"
