#!/usr/bin/env python3
"""Where the CPU spends a vLLM step: a summary of a torch profiler trace.

Reads a Chrome trace written by vLLM's torch profiler (``*.pt.trace.json[.gz]``) and,
for each of vLLM's ``gpu_model_runner: forward`` annotations (the forward pass of one
step, as issued by the CPU; with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``, else each whole
step), prints how long the CPU took, the CUDA runtime calls
that took the most of that time (a launch queue that is full, or a synchronization,
shows here), the slowest operators, and the longest stretches in which the thread
issued no CUDA call at all (Python work, or a lock or the GIL held elsewhere).  The last
line is one JSON object.

``--compare A B`` instead puts two of vLLM's whole steps side by side (``execute_context``
annotations, in order; -1: the last): the names (Python functions, CUDA runtime and
driver calls, operators) whose time in step A exceeds their time in step B the most, and
each step's GPU time by kind and stream: where a restarted engine's first request spends
what its later ones do not.

    python3 scripts/trace_summary.py TRACE [--top 12] [--compare 0 -1]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json
from pathlib import Path
from typing import Any

FORWARD = "gpu_model_runner: forward"
"""vLLM's annotation of a forward pass (with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``)"""
STEP = "execute_context"
"""the prefix of vLLM's annotation of a whole step (always there)"""


def load(path: Path) -> list[dict[str, Any]]:
    """The complete (``ph == "X"``) events of a trace file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _is_step(e: dict[str, Any]) -> bool:
    """Whether ``e`` is vLLM's annotation of a whole step."""
    return e.get("cat") == "user_annotation" and e["name"].startswith(STEP)


def _within(e: dict[str, Any], t0: float, t1: float, tid: Any) -> bool:
    return e.get("tid") == tid and t0 <= e["ts"] and e["ts"] + e["dur"] <= t1


def _enclosing(e: dict[str, Any], frames: list[dict[str, Any]]) -> str:
    """The innermost Python frame around event ``e``."""
    best = None
    for f in frames:
        if f["ts"] <= e["ts"] and e["ts"] + e["dur"] <= f["ts"] + f["dur"]:
            if best is None or f["dur"] < best["dur"]:
                best = f
    return best["name"] if best else "?"


def summarize(events: list[dict[str, Any]], top: int = 12) -> list[dict[str, Any]]:
    """One summary per forward pass found in ``events``."""
    out = []
    windows = [e for e in events if e["name"] == FORWARD] or [e for e in events if _is_step(e)]
    for fw in sorted(windows, key=lambda e: e["ts"]):
        t0, t1, tid = fw["ts"], fw["ts"] + fw["dur"], fw["tid"]
        inside = [e for e in events if _within(e, t0, t1, tid)]
        runtime = [e for e in inside if e.get("cat") == "cuda_runtime"]
        frames = [e for e in inside if e.get("cat") == "python_function"]
        ops = [e for e in inside if e.get("cat") == "cpu_op"]
        by_call: dict[str, list[float]] = collections.defaultdict(list)
        for e in runtime:
            by_call[e["name"]].append(e["dur"])
        calls = sorted(by_call.items(), key=lambda kv: -sum(kv[1]))[:top]
        slow = sorted(runtime, key=lambda e: -e["dur"])[:top]
        by_op: dict[str, list[float]] = collections.defaultdict(list)
        for e in ops:
            by_op[e["name"]].append(e["dur"])
        heavy = sorted(by_op.items(), key=lambda kv: -sum(kv[1]))[:top]
        marks = sorted([t0] + [e["ts"] for e in runtime] + [t1])
        gaps = sorted(((b - a, a) for a, b in itertools.pairwise(marks)), reverse=True)[:top]
        out.append(
            {
                "window": fw["name"],
                "forward_ms": round(fw["dur"] / 1e3, 2),
                "runtime_calls": len(runtime),
                "runtime_ms_by_call": {
                    k: [len(v), round(sum(v) / 1e3, 2), round(max(v) / 1e3, 2)] for k, v in calls
                },
                "slowest_runtime_calls": [
                    [
                        e["name"],
                        round(e["dur"] / 1e3, 2),
                        round((e["ts"] - t0) / 1e3, 1),
                        _enclosing(e, frames),
                    ]
                    for e in slow
                ],
                "ops_ms": {k: [len(v), round(sum(v) / 1e3, 2)] for k, v in heavy},
                "longest_without_cuda_calls": [
                    [
                        round(g / 1e3, 2),
                        round((a - t0) / 1e3, 1),
                        _enclosing({"ts": a, "dur": g}, frames),
                    ]
                    for g, a in gaps
                ],
            }
        )
    return out


#: the event kinds :func:`compare` counts on the CPU side
_CPU_KINDS = ("python_function", "cuda_runtime", "cuda_driver", "cpu_op", "user_annotation")
#: the event kinds it counts as GPU time
_GPU_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


def _step_totals(events: list[dict[str, Any]], step: dict[str, Any]) -> dict[str, Any]:
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    cpu: dict[str, list[float]] = collections.defaultdict(list)
    gpu: collections.Counter[str] = collections.Counter()
    for e in events:
        if not t0 <= e["ts"] <= t1:
            continue
        if e.get("cat") in _GPU_KINDS:  # queued in the step, run on the device
            gpu[f"{e['cat']}/stream {e.get('tid')}"] += e["dur"]
        elif e.get("cat") in _CPU_KINDS and e["ts"] + e["dur"] <= t1 and not _is_step(e):
            cpu[f"{e['cat']}: {e['name'][:120]}"].append(e["dur"])
    return {"cpu": cpu, "gpu": gpu}


def compare(events: list[dict[str, Any]], a: int, b: int, top: int = 12) -> dict[str, Any]:
    """Step ``a`` against step ``b`` (indexes into vLLM's ``execute_context`` steps)."""
    steps = sorted(filter(_is_step, events), key=lambda e: e["ts"])
    sa, sb = _step_totals(events, steps[a]), _step_totals(events, steps[b])
    ca, cb = sa["cpu"], sb["cpu"]  # defaultdicts: a name missing from one step is []
    extra = {k: sum(ca[k]) - sum(cb[k]) for k in set(ca) | set(cb)}
    more = sorted(extra, key=extra.__getitem__, reverse=True)
    return {
        "steps_ms": [round(s["dur"] / 1e3, 2) for s in steps],
        "compared": [a, b],
        "more_in_a": [[k, round(extra[k] / 1e3, 2), len(ca[k]), len(cb[k])] for k in more[:top]],
        "gpu_ms": [
            {k: round(v / 1e3, 2) for k, v in st["gpu"].most_common(top)} for st in (sa, sb)
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--compare", type=int, nargs=2, metavar=("A", "B"), default=None)
    args = ap.parse_args()
    if args.compare:
        got = compare(load(args.trace), *args.compare, top=args.top)
        print(f"steps (ms): {got['steps_ms']}")
        for name, extra, na, nb in got["more_in_a"]:
            print(f"  {extra:+8.2f} ms  {name} ({na} vs {nb} events)")
        print(json.dumps(got))
        return
    steps = summarize(load(args.trace), args.top)
    for i, s in enumerate(steps):
        print(f"forward {i}: {s['forward_ms']} ms, {s['runtime_calls']} CUDA runtime calls")
        for name, (n, total, worst) in s["runtime_ms_by_call"].items():
            print(f"  {name}: {n} calls, {total} ms, longest {worst} ms")
    print(json.dumps({"trace": str(args.trace), "forwards": steps}))


if __name__ == "__main__":
    main()
