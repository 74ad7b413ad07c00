#!/usr/bin/env python3
"""TTFT of real vLLM on a GPU with PegaKVConnector, as users run it (run on the H200).

The model is Llama-3.1-8B's public shape with dummy weights (bf16, block size 16), every
engine in vLLM's default mode (torch.compile and CUDA graphs; ``--eager``: eager mode);
prompts are ``--tokens`` token ids, ``max_tokens=1``.  A ``pegaflow-server`` with its
*default* settings (default pool size and ports) holds the cache on the same host.
Passes, each in a new engine process (a restart: empty GPU cache), the same run also
measuring vLLM's own prefix-cache hit (the floor) and a pinned-memcpy ceiling:

1. **cold**: an engine with the connector (its own prefix cache off) computes set ``A``
   (``--prompts`` prompts, paced: ``--pause`` before each), the batch set ``C``
   (``--batch`` prompts in one ``generate`` call; ``--batches`` N: N - 1 more like it)
   and, unless ``--eager``, the batch set ``E`` (below), and saves them.
2. **plain**: vLLM with no connector: cold TTFT on set A, then its own GPU prefix-cache
   hit on set A, back to back (the floor), then set C twice (the second all in the GPU).
3. **defaults**: the connector with the three documented keys and nothing else
   (``PYTHONHASHSEED`` as the README says), timed from its first request as users meet
   a restarted engine: no warm-up request, no wait for the connector to pin the node's
   pool.  Set A back to back (no pause: the restart set), at once set C (the batch after
   the start); then, once the pool is pinned (60 s at most) and vLLM's own prefix cache
   is emptied (the same prompts are the connector's hits again), the steady state: set A
   back to back, at once set C, the other ``--batches`` sets (paced), then set E; the
   engine exits right after its last request.  (A steady set of its own would not fit
   the server's default pool beside sets A, C and E: 31.4 GiB on the H200, 25 prompts of
   10k tokens.)  ``--no-decline``: its connector's cost model off too
   (``PEGAFLOW_CONNECTOR_COST_MODEL=0``: every hit claimed; do declines help?).
4. **tuned**: ``local_node`` set by hand, set A paced (what "defaults" must match).

Every other engine with the connector is timed once its connector has pinned the pool
for DMA (in the background, seconds for tens of GiB; unless ``--eager``, only once the
engine ran a step: after a warm-up request).  Unless ``--eager``, the cold and defaults
engines also run the batch set ``E`` of ``--tokens`` + 1 tokens: its hits leave one
token to compute, so vLLM would replay a full CUDA graph for their step, where the
connector's layer-wise waits cannot run (it asks vLLM for piecewise graphs).

Last line: one JSON object.  TTFT in ms per request, in order (``*_mean_ms``,
``ttft_*_ms``: means); cached tokens per request (a full 10k-token hit: 9,984); outputs
compared with the cold engine's (dummy weights are seeded: equal engines, equal tokens):

- ``restart_ms``, ``restart_mean_ms``, ``restart_cached_tokens``: the restart set;
  ``batch_after_start_ms``: the batch right after it; with ``--profile-restart``
  (``restart_profiled``: these then hold the profiler's cost) ``restart_trace_compare``:
  its first request's step against its last one's (``trace_summary.compare``);
- ``pinned_defaults_s``: seconds from the defaults engine's start until the last rank's
  "pinned for DMA" line reached the script (null: not within 60 s of the batch);
  ``pinning_after_first_request_s``: how long it went on after the first request was
  sent (0: it was over by then); ``restart_during_pinning``, ``batch_during_pinning``: it
  had not when the restart set, the batch, ended;
- ``steady_ms``, ``steady_mean_ms`` (= ``ttft_warm_back_to_back_ms``),
  ``steady_cached_tokens``: set A in the steady state; ``restart_max_over_steady``:
  max(``restart_ms``) / ``steady_mean_ms`` (issue 38's targets: <= 1.2; mean <= 45 ms);
- ``batch_steady_ms``: mean of the steady batches (``batch_steady_all_ms``: C, then
  the other ``--batches`` sets); ``cost_model``: the defaults connector's, on or off;
- ``one_token_batch_ms``, ``one_token_cached_tokens``, ``one_token_outputs_match``: E;
- ``cold_ms`` / ``ttft_cold_ms``, ``batch_cold_ms``: the cold engine's set A and C;
  ``plain_cold_ms``, ``plain_local_hit_ms`` / ``ttft_local_hit_ms``,
  ``plain_batch_hit_ms``: vLLM alone (the last two: its own GPU hits);
- ``warm_tuned_ms`` / ``ttft_warm_tuned_ms``; ``default_over_tuned``, the steady mean
  over it; ``back_to_back_over_floor``: the steady mean / ``ttft_local_hit_ms``;
- ``pinned_h2d_gbps`` (the ceiling), ``batch_floor_ms`` (set C's KV at it),
  ``batch_x_ceiling`` = ``batch_floor_ms`` / ``batch_steady_ms``;
- ``batch_cached_tokens``: per engine, its set C (defaults: the batch after the start);
- ``outputs_match_cold``: the defaults engine's sets A and C (both times), the tuned and
  plain engines' set A; ``batches_outputs_match``: the other ``--batches`` sets;
- ``start_<pass>_s``, ``pinned_<pass>_s``: each engine's start and pinning, from its
  start (null: not pinned within 60 s); ``batch_phases_ms`` (``--batch-phases``): per
  engine, each batch in the order run, split at vLLM's marks (:func:`phases_of`).

With ``--tp N`` (N > 1) every engine runs with ``tensor_parallel_size`` N (NVLink
multicast off, :func:`tp_env`); the ceiling is measured on the N GPUs at once, each
copying its rank's share of a prompt's KV (``per_rank_ceiling_gbps``; ``pinned_h2d_gbps``
their sum, the batch floor the slowest rank's share); each rank's load rate, from its
own stats file, against its own ceiling: ``ranks_load_x_ceiling`` per window
(``restart``: the restart set and batch; ``steady``: the steady set and batches;
``tuned``), rate = the bytes it loaded / the window's summed request times (a lower
bound of its copy rate); ``ranks_load_job_gbps``: the same bytes / its summed load job
times (which overlap in a batch).  Then a cross-TP pass: a TP=1 engine with the
connector on prompts of set A must get no hit (the namespace includes the TP size),
then hits on its own saves with its cold outputs; a TP=N engine on prompts only the TP=1
engine saved must get none, then hits on set A with the cold run's outputs
(``cross_tp_cached_tokens``, ``cross_tp_ok``).

The KV oracle (issue 36: dummy weights give the reference tokens even from all-zero KV),
after the timed passes unless ``--tp`` > 1 or ``--skip-kv-oracle``: two more engines
with the three keys, each with its engine core in the script's engine process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, where ``kv_digest`` of
``tests/support/vllm_runner.py`` reads the KV cache) and vLLM's prefix cache on (it
keeps a finished request's blocks).  ``kv_oracle_cold`` computes fresh prompts
(:data:`ORACLE_PROMPTS` paced, as many in one batch, unless ``--eager`` as many one-token
hits as set E) and saves them; ``kv_oracle``, a new process, hits them the same way.
Per hit block, over every layer, its KV's digest must equal the cold engine's
(:func:`kv_oracle`): ``kv_oracle_blocks`` compared, ``kv_oracle_mismatches``,
``kv_oracle_ok``; the script exits 1 when it is false.

    python3 scripts/bench_vllm_gpu.py [--prompts 8] [--batch 8] [--tokens 10000] [--tp 1]
        [--eager] [--no-decline]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pegaflow.tools.devcluster import start_server  # noqa: E402
from scripts._common import trap_signals  # noqa: E402
from scripts._models import LLAMA_31_8B  # noqa: E402
from tests.support.script_module import load_script  # noqa: E402
from tests.support.vllm_engine import VllmEngine, prompts, wait_saved  # noqa: E402
from tests.support.vllm_engine import connector_stats as stats  # noqa: E402

TRACE_SUMMARY = load_script("trace_summary")
"""``scripts/trace_summary.py``: summaries of the torch profiler's traces"""


def pinned_h2d_gbps(nbytes: int) -> float:
    """This GPU's pinned host-to-device copy rate (GB/s) for one copy of ``nbytes``."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


#: NVLink multicast off in NCCL, PyTorch and NVSHMEM: on the shared multi-GPU machines a
#: program that uses it can put the host's GPUs out of service (the device KINDS.md)
NO_MULTICAST: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
#: a copy round waits this long at most for the other ranks' copies to start
ROUND_WAIT_S = 120.0
#: a little over the connector's delay before it rewrites its stats file (0.3 s)
STATS_SETTLE_S = 0.5
#: prompts of set A (and of the fresh set D) that the cross-TP pass sends
CROSS_PROMPTS = 2
#: prompts of each of the KV oracle's sets (paced, one batch, one-token batch)
ORACLE_PROMPTS = 2
#: the engine core in the engine's own process, where ``kv_digest`` reads the KV cache
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: vLLM's block size in every engine of the bench
BLOCK_SIZE = 16
#: the longest wait for an engine's connector to pin the node's pool (4-5 s for 31 GiB)
PIN_WAIT_S = 60.0
#: how often a :class:`PinWatch` reads the engine's log
PIN_POLL_S = 0.01


def pinned_ranks(log: list[str]) -> set[str]:
    """The processes (``pid=N`` of vLLM's line prefix) whose connector said it pinned the
    node's pool for DMA."""
    return {
        m.group(1) if (m := re.search(r"pid=(\d+)", x)) else x for x in log if "pinned for DMA" in x
    }


class PinWatch:
    """When every rank's connector had said it pinned the node's pool for DMA: a thread
    reads the engine's ``log`` as it grows (:func:`pinned_ranks`, every
    :data:`PIN_POLL_S`) for the time the last rank's line came; ``started``: the
    ``time.monotonic()`` of the engine's start."""

    def __init__(self, log: list[str], ranks: int, started: float) -> None:
        self.started = started
        self.at: float | None = None
        self._done = threading.Event()
        self._stop = threading.Event()
        threading.Thread(target=self._watch, args=(log, ranks), daemon=True).start()

    def _watch(self, log: list[str], ranks: int) -> None:
        while not self._stop.is_set():
            if len(pinned_ranks(list(log))) >= ranks:  # a copy: the engine's pump appends
                self.at = time.monotonic()
                self._done.set()
                return
            self._stop.wait(PIN_POLL_S)

    def wait(self, timeout: float) -> float | None:
        """Block until every rank pinned the pool or ``timeout`` passes (then stop
        watching); seconds from the engine's start to the pinning (None: not pinned)."""
        if not self._done.wait(timeout):
            self._stop.set()
        return None if self.at is None else round(self.at - self.started, 1)

    def after(self, t: float) -> float | None:
        """Seconds the pinning went on after ``t`` (``time.monotonic()``; 0: it was over
        by then; None: not seen to end)."""
        return None if self.at is None else round(max(0.0, self.at - t), 1)

    def during(self, t: float) -> bool:
        """Whether the pinning still ran at ``t`` (``time.monotonic()``), as far as this
        watch saw before it ended."""
        return self.at is None or self.at > t


def empty_gpu_cache(engine: Any, timeout: float = 30.0) -> None:
    """Empty vLLM's own prefix cache, so the prompts sent next are the connector's hits;
    vLLM refuses while blocks are still in use (saves in flight), so ask again until
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while not engine.call({"op": "reset_prefix_cache"})["ok"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{engine.name}: vLLM's prefix cache did not empty in {timeout} s")
        time.sleep(0.2)


def restart_figures(restart_ms: list[float], steady_ms: list[float]) -> dict[str, float]:
    """The restart set against the steady state (issue 38's targets: every request of a
    restarted engine within 1.2x of the steady mean, and that mean <= 45 ms at 10k
    tokens on the H200): both means and the slowest restart request / the steady mean."""
    steady = statistics.mean(steady_ms)
    return {
        "restart_mean_ms": round(statistics.mean(restart_ms), 1),
        "steady_mean_ms": round(steady, 1),
        "restart_max_over_steady": round(max(restart_ms) / steady, 2),
    }


def tp_env(tp: int) -> dict[str, str]:
    """What an engine of ``tp`` GPUs gets in its environment: multicast off when > 1."""
    return dict(NO_MULTICAST) if tp > 1 else {}


def rank_share(nbytes: int, ranks: int) -> int:
    """Bytes of ``nbytes`` of KV that each of ``ranks`` TP ranks holds (its KV heads)."""
    return nbytes // ranks


def concurrent_copy_gbps(
    make_copy: Callable[[int], Callable[[], None]], nbytes: int, ranks: int, rounds: int = 5
) -> list[float]:
    """Each rank's copy rate (GB/s, best of ``rounds``) with every rank copying at once.

    ``make_copy(rank)`` (run in that rank's thread) prepares its buffers and returns one
    copy of ``nbytes`` that returns once the copy is done; every round starts all ranks'
    copies together.  The first error of any rank is raised here."""
    best = [math.inf] * ranks
    errors: list[BaseException] = []
    start = threading.Barrier(ranks)

    def run(rank: int) -> None:
        try:
            copy = make_copy(rank)
            for _ in range(rounds):
                start.wait(timeout=ROUND_WAIT_S)
                t0 = time.perf_counter()
                copy()
                best[rank] = min(best[rank], time.perf_counter() - t0)
        except BaseException as e:  # handed to the caller below
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return [nbytes / max(b, 1e-9) / 1e9 for b in best]


def pinned_copy(nbytes: int) -> Callable[[int], Callable[[], None]]:
    """For :func:`concurrent_copy_gbps`: a pinned host-to-device copy of ``nbytes`` on
    GPU ``rank`` (its buffers live as long as the copy function)."""

    def make(rank: int) -> Callable[[], None]:
        import torch

        torch.cuda.set_device(rank)
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{rank}")
        torch.cuda.synchronize(rank)

        def copy() -> None:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(rank)

        return copy

    return make


def rank_ceilings_gbps(nbytes: int, ranks: int) -> list[float]:
    """GPUs 0..ranks-1's pinned host-to-device rates (GB/s), all copying ``nbytes`` at
    the same time (as a TP engine's ranks load their shards)."""
    import torch

    if torch.cuda.device_count() < ranks:
        raise SystemExit(f"--tp {ranks} needs {ranks} GPUs; {torch.cuda.device_count()} here")
    rates = concurrent_copy_gbps(pinned_copy(nbytes), nbytes, ranks)
    for r in range(ranks):
        with torch.cuda.device(r):
            torch.cuda.empty_cache()
    return rates


def floor_ms(total_bytes: int, ceilings_gbps: list[float]) -> float:
    """Time (ms) to copy ``total_bytes`` of KV split evenly over the ranks, each at its
    own ceiling: the slowest rank decides (one rank: the whole copy at its ceiling)."""
    share = total_bytes / len(ceilings_gbps)
    return max(share / (c * 1e9) for c in ceilings_gbps) * 1000


def rank_stats(prefix: str, ranks: int) -> list[dict[str, float]]:
    """Each worker's cumulative connector counters, from its own stats file
    (``<prefix>.worker<rank>.json``; empty where absent or being replaced)."""
    out: list[dict[str, float]] = []
    for r in range(ranks):
        try:
            with open(f"{prefix}.worker{r}.json") as fh:
                out.append({k: float(v) for k, v in json.load(fh).items()})
        except (OSError, ValueError):
            out.append({})
    return out


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def rank_load_gbps(
    before: list[dict[str, float]], after: list[dict[str, float]], wall_s: float
) -> list[float]:
    """Each rank's load rate (GB/s) over a window of ``wall_s`` seconds: the bytes it
    loaded between the two :func:`rank_stats` readings / the window's wall time."""
    if wall_s <= 0:
        return [0.0] * len(after)
    return [_delta(b, a, "load_bytes") / wall_s / 1e9 for b, a in zip(before, after, strict=True)]


def rank_job_gbps(before: list[dict[str, float]], after: list[dict[str, float]]) -> list[float]:
    """Each rank's bytes loaded / its summed load-job wall times (GB/s) between two
    readings; 0 where no load time was counted."""
    out: list[float] = []
    for b, a in zip(before, after, strict=True):
        secs = _delta(b, a, "load_seconds")
        out.append(_delta(b, a, "load_bytes") / secs / 1e9 if secs > 0 else 0.0)
    return out


def x_ceiling(rates: list[float], ceilings: list[float]) -> list[float]:
    """Each rank's rate against its own ceiling, rounded to 0.01 (0 for no ceiling)."""
    return [round(r / c, 2) if c > 0 else 0.0 for r, c in zip(rates, ceilings, strict=True)]


def cross_tp_ok(cached: dict[str, list[int]], outputs_match: bool) -> bool:
    """The cross-TP verdict: no hit across TP sizes (``tp1_on_tpN``, ``tpN_on_tp1``),
    hits on each engine's own saves (``tp1_own``, ``tpN_own``: the connector worked, so
    the zeros mean something), and outputs equal to each TP size's cold outputs."""
    crossed = cached.get("tp1_on_tpN", [1]) + cached.get("tpN_on_tp1", [1])
    own = cached.get("tp1_own", [0]) + cached.get("tpN_own", [0])
    return outputs_match and not any(crossed) and all(own)


def phases_of(phases_ms: list[list[float]], elapsed_ms: float) -> dict[str, float]:
    """One batch's time split at vLLM's own marks (``phases_ms``: per request, ms from
    the call to its engine-core queueing, first scheduling and first token): before
    the first request is queued; from then to its scheduling (adding and hashing the
    batch); from the first scheduling to the last first token (the connector's lookups
    and loads, the forward pass); and after it (outputs back to the caller)."""
    queued = min(p[0] for p in phases_ms)
    scheduled = min(p[1] for p in phases_ms)
    token = max(p[2] for p in phases_ms)
    return {
        "to_queued": round(queued, 1),
        "queued_to_scheduled": round(scheduled - queued, 1),
        "scheduled_to_last_token": round(token - scheduled, 1),
        "after_last_token": round(elapsed_ms - token, 1),
        "steps_scheduled": len({p[1] for p in phases_ms}),
    }


def diagnose(
    start: Any, batch: Any, set_c: list[list[int]], warm_up: list[list[int]],
    args: argparse.Namespace, out: dict[str, Any], where: Path,
) -> None:  # fmt: skip
    """Where a batch of hits spends its time: an engine with the connector's debug log
    runs the batch under vLLM's torch profiler (summarized by ``scripts/trace_summary.py``
    into ``where/trace_summary.json``), then twice more (its lines on stderr, with the
    CPU's time to each layer), vLLM's own cache emptied before each."""
    prof = where / "profile"
    env = {"PEGAFLOW_CONNECTOR_LOG_LEVEL": "debug", "VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1"}
    e = start("diagnose", three_keys=True, profile_dir=str(prof), env=env)
    try:
        e.generate(warm_up, 1)
        # first under the profiler: a batch's first steps meet shapes the engine has not
        # run yet (what a restarted engine's first batch does)
        time.sleep(args.pause)
        e.call({"op": "start_profile"})
        mark = len(e.log)
        out["batch_profiled_ms"] = round(batch(e, set_c)[0], 1)
        e.call({"op": "stop_profile"}, timeout=300)
        print("\n".join(x for x in e.log[mark:] if "PegaFlow" in x), file=sys.stderr)
        for i in (1, 2):
            empty_gpu_cache(e)
            time.sleep(args.pause)
            mark = len(e.log)
            out[f"batch_diagnose_{i}_ms"] = round(batch(e, set_c)[0], 1)
            time.sleep(1.0)
            print("\n".join(x for x in e.log[mark:] if "PegaFlow" in x), file=sys.stderr)
    finally:
        e.stop()
    events = trace_events(prof)
    if events:
        steps = TRACE_SUMMARY.summarize(events)
        (where / "trace_summary.json").write_text(json.dumps(steps, indent=1))
        for i, st in enumerate(steps):
            print(f"profiled step {i}: {json.dumps(st)}", file=sys.stderr)


def trace_events(prof: Path) -> list[dict[str, Any]]:
    """The events of the largest torch profiler trace vLLM wrote under ``prof`` (the
    worker's), or none."""
    traces = sorted(prof.rglob("*.pt.trace.json*"), key=lambda p: p.stat().st_size)
    return TRACE_SUMMARY.load(traces[-1]) if traces else []


Runs = list[tuple[float, int, list[int]]]


def cross_tp_pass(
    start: Any, timed: Any, cold_a: Runs, set_a: list[list[int]], warm_up: list[list[int]],
    args: argparse.Namespace, work: Path, out: dict[str, Any],
) -> None:  # fmt: skip
    """Blocks of one TP size are no hits for another (the namespace includes it).

    A TP=1 engine with the connector (vLLM's prefix cache off) gets :data:`CROSS_PROMPTS`
    prompts of set A, which only TP=``args.tp`` engines saved: no hit; it also computes
    a fresh set D, then gets set A's prompts again: hits on its own saves, with its
    first outputs.  Then a TP=``args.tp`` engine gets set D, which only the TP=1 engine
    saved: no hit; then set A's prompts: hits, with the cold run's outputs."""
    ours = set_a[:CROSS_PROMPTS]
    set_d = prompts(CROSS_PROMPTS, args.tokens, seed=40_000, vocab=128_000)
    s_one = str(work / "cross_tp1")
    e = start("cross_tp1", env={"PEGAFLOW_CONNECTOR_STATS_PATH": s_one}, three_keys=True,
              prefix_caching=False, tp=1)  # fmt: skip
    try:
        e.generate(warm_up, 1)
        tp1_first = [timed(e, p, args.pause) for p in ours]
        for p in set_d:
            timed(e, p, args.pause)
        n = 2 * CROSS_PROMPTS * (args.tokens // 16) + 1024 // 16
        print(f"cross_tp1 counters: {wait_saved(s_one, n, timeout=300)}", flush=True)
        tp1_again = [timed(e, p, args.pause) for p in ours]
    finally:
        e.stop()
    name = f"cross_tp{args.tp}"
    s_n = str(work / name)
    e = start(name, env={"PEGAFLOW_CONNECTOR_STATS_PATH": s_n}, three_keys=True)
    try:
        e.generate(warm_up, 1)
        tpn_on_tp1 = [timed(e, p, args.pause) for p in set_d]
        tpn_own = [timed(e, p, args.pause) for p in ours]
    finally:
        e.stop()
        print(f"{name} counters: {stats(s_n)}", flush=True)

    def cached(xs: Runs) -> list[int]:
        return [c for _, c, _ in xs]

    def outputs(xs: Runs) -> list[list[int]]:
        return [o for _, _, o in xs]

    got = {
        "tp1_on_tpN": cached(tp1_first),
        "tp1_own": cached(tp1_again),
        "tpN_on_tp1": cached(tpn_on_tp1),
        "tpN_own": cached(tpn_own),
    }
    match = outputs(tp1_again) == outputs(tp1_first) and outputs(tpn_own) == outputs(
        cold_a[:CROSS_PROMPTS]
    )
    out["cross_tp_cached_tokens"] = got
    out["cross_tp_outputs_match"] = match
    out["cross_tp_ok"] = cross_tp_ok(got, match)
    print(f"cross-TP: {got}, outputs match: {match}", flush=True)


Digests = list[str | None]


def kv_oracle(
    reference: list[Digests], got: list[Digests], cached: list[int], block_size: int = BLOCK_SIZE
) -> tuple[int, int]:
    """The KV oracle's count over prompts: the blocks of each prompt that its hit
    covered (the first ``cached // block_size``) and, among them, those whose digest in
    the hit engine (``got``) is not the one of the engine that computed them
    (``reference``), or that either engine no longer holds (None).  The blocks after a
    hit the hit engine computed itself, in kernels of other shapes whose bf16 sums may
    differ in the last bit: not compared."""
    blocks = mismatches = 0
    for ref, mine, c in zip(reference, got, cached, strict=True):
        n = c // block_size
        blocks += n
        for i in range(n):
            want = ref[i] if i < len(ref) else None
            have = mine[i] if i < len(mine) else None
            mismatches += want is None or want != have
    return blocks, mismatches


def oracle_sets(args: argparse.Namespace) -> list[list[list[int]]]:
    """The KV oracle's requests, each one ``generate`` call: :data:`ORACLE_PROMPTS`
    fresh prompts one at a time, as many in one batch, and unless ``--eager`` as many of
    ``--tokens`` + 1 tokens in one batch (one token left to compute, as set E)."""
    paced = prompts(ORACLE_PROMPTS, args.tokens, seed=60_000, vocab=128_000)
    sets = [[p] for p in paced]
    sets.append(prompts(ORACLE_PROMPTS, args.tokens, seed=61_000, vocab=128_000))
    if not args.eager:
        sets.append(prompts(ORACLE_PROMPTS, args.tokens + 1, seed=62_000, vocab=128_000))
    return sets


def kv_oracle_pass(
    start: Any, args: argparse.Namespace, warm_up: list[list[int]], work: Path,
    out: dict[str, Any],
) -> None:  # fmt: skip
    """The KV oracle, after the timed passes (module docstring): ``kv_oracle_cold``
    computes :func:`oracle_sets` and saves them, ``kv_oracle`` (a new process, the
    three keys as ``defaults``) hits them; the digests of the hit blocks must equal the
    cold engine's.  Both engines read their KV once their requests are done."""
    sets = oracle_sets(args)
    every = [p for s in sets for p in s]

    def run(name: str) -> tuple[list[int], list[list[int]], list[Digests]]:
        stats_path = str(work / name)
        e = start(name, env={**IN_PROCESS, "PEGAFLOW_CONNECTOR_STATS_PATH": stats_path},
                  three_keys=True, prefix_caching=True)  # fmt: skip
        try:
            e.generate(warm_up, 1)
            cached: list[int] = []
            outputs: list[list[int]] = []
            for s in sets:
                time.sleep(args.pause)
                r = e.generate(s, max_tokens=1)
                cached += r["cached"]
                outputs += r["outputs"]
            digests = [e.kv_digest(p) for p in every]
            if name == "kv_oracle_cold":  # its saves reach the node before it exits
                n = sum(len(p) // BLOCK_SIZE for p in every)
                print(f"{name} counters: {wait_saved(stats_path, n, timeout=300)}", flush=True)
        finally:
            e.stop()
        return cached, outputs, digests

    cold_cached, cold_out, reference = run("kv_oracle_cold")
    cached, outputs, got = run("kv_oracle")
    blocks, mismatches = kv_oracle(reference, got, cached)
    out["kv_oracle_cached_tokens"] = cached
    out["kv_oracle_cold_cached_tokens"] = cold_cached
    out["kv_oracle_outputs_match"] = outputs == cold_out
    out["kv_oracle_blocks"] = blocks
    out["kv_oracle_mismatches"] = mismatches
    # a cold hit would make the reference loaded KV, not computed; no block compared
    # says nothing
    out["kv_oracle_ok"] = blocks > 0 and mismatches == 0 and not any(cold_cached)
    print(f"KV oracle: {blocks} hit blocks compared, {mismatches} differ", flush=True)


#: the script's switches, each with its help
SWITCHES = {
    "--diagnose": "one more engine, with the connector's debug log, runs the batch (its "
    "lines go to stderr): where the batch's time goes",
    "--diagnose-only": "the cold engine, then --diagnose alone",
    "--profile-restart": "the defaults engine runs its restart set under vLLM's torch "
    "profiler (restart_ms then holds the profiler's cost: restart_profiled): "
    "restart_trace_compare puts the first request's step against the last one's "
    "(scripts/trace_summary.py --compare 0 -1), the trace stays under --log-dir",
    "--batch-phases": "vLLM's request stats on in the plain and defaults engines: each batch "
    "split into its time before the first request is scheduled, to the last first token, "
    "and after it (batch_phases_ms)",
    "--compare-lookahead": "one more engine (the three keys, load_lookahead_layers 0: every "
    "layer's copies queued at once) runs the batch first: batch_all_at_once_ms",
    "--compare-early-start": "one more engine (the three keys, early_start off: a step's "
    "copies queued when vLLM launches it) runs the batch first: batch_late_start_ms",
    "--eager": "engines in eager mode, not as vLLM runs them by default (compiled, CUDA "
    "graphs); leaves out the one-token batch set E",
    "--no-decline": "the defaults engine with the connector's cost model off "
    "(PEGAFLOW_CONNECTOR_COST_MODEL=0: every hit claimed): cost_model false",
    "--skip-tuned": "leave out the tuned pass",
    "--skip-kv-oracle": "leave out the KV oracle (two more engines after the timed passes)",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--prompts", type=int, default=8, help="prompts in set A (the restart and steady sets)"
    )
    ap.add_argument("--batch", type=int, default=8, help="prompts in the batch set C")
    ap.add_argument(
        "--batches",
        type=int,
        default=1,
        help="batch sets (C and more like it); the defaults engine runs the others after "
        "set C in its steady state, one after another: batch_steady_ms is their mean",
    )
    ap.add_argument("--tokens", type=int, default=10_000)
    ap.add_argument("--kv-cache-gb", type=float, default=40.0)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds before a paced request")
    ap.add_argument("--log-dir", default="", help="write each engine's output there")
    for flag, text in SWITCHES.items():
        ap.add_argument(flag, action="store_true", help=text)
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor_parallel_size of every engine (GPUs 0..N-1); N > 1 adds the per-rank "
        "ceilings and load rates and the cross-TP pass",
    )
    ap.add_argument(
        "--pool-size",
        default="",
        help="the server's pool (pegaflow-server --pool-size, e.g. 48GiB); default: its own "
        "default size (too small where the host's MemTotal reads low at start)",
    )
    args = ap.parse_args()
    trap_signals()  # killed by timeout or a signal: the engines and the server stop too
    if args.tp < 1:
        ap.error("--tp must be at least 1")
    # the server, this process and every engine (and their workers) inherit it
    os.environ.update(tp_env(args.tp))

    work = Path(tempfile.mkdtemp(prefix="pf-gpu-bench-"))
    model_dir = work / "llama-3.1-8b-dummy"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA_31_8B))
    batch_tokens = args.batch * (args.tokens + 64)
    spec = {
        "model": str(model_dir),
        "block_size": BLOCK_SIZE,
        "max_model_len": args.tokens + 64,
        "max_num_batched_tokens": batch_tokens,
        "kv_cache_bytes": int(args.kv_cache_gb * 1e9),
        "tp": args.tp,
        "cuda_graphs": not args.eager,
    }
    set_a = prompts(args.prompts, args.tokens, seed=10_000, vocab=128_000)
    set_cs = [prompts(args.batch, args.tokens, seed=30_000 + 1000 * i, vocab=128_000)
              for i in range(max(1, args.batches))]  # fmt: skip
    set_c = set_cs[0]
    # one token left to compute per hit: a step vLLM would run as a full CUDA graph
    set_e = prompts(args.batch, args.tokens + 1, seed=50_000, vocab=128_000)
    if args.eager:
        set_e = []
    warm_up = prompts(1, 1024, seed=7, vocab=128_000)
    kv_bytes_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads, head 128, bf16
    prompt_bytes = args.tokens * kv_bytes_per_token
    if args.tp == 1:
        ceilings = [pinned_h2d_gbps(prompt_bytes)]
    else:  # every rank copies its share of a prompt's KV, all at the same time
        ceilings = rank_ceilings_gbps(rank_share(prompt_bytes, args.tp), args.tp)
    ceiling = sum(ceilings)
    out: dict[str, Any] = {"tokens": args.tokens, "prompts": args.prompts, "batch": args.batch}
    out["pinned_h2d_gbps"] = round(ceiling, 1)
    print(f"pinned H2D ceiling {ceiling:.1f} GB/s", flush=True)
    if args.tp > 1:
        out["tp"] = args.tp
        out["per_rank_ceiling_gbps"] = [round(c, 1) for c in ceilings]
        print(f"per-rank ceilings, all at once: {out['per_rank_ceiling_gbps']} GB/s", flush=True)

    def timed(engine: VllmEngine, p: list[int], pause: float) -> tuple[float, int, list[int]]:
        if pause:
            time.sleep(pause)
        r = engine.generate([p], max_tokens=1)
        return r["elapsed_s"] * 1000.0, r["cached"][0], r["outputs"][0]

    batch_cached: dict[str, list[int]] = {}
    batch_phases: dict[str, list[dict[str, float]]] = {}

    def batch(engine: VllmEngine, ps: list[list[int]]) -> tuple[float, list[list[int]]]:
        r = engine.generate(ps, max_tokens=1)
        batch_cached[engine.name] = r["cached"]
        if "phases_ms" in r:
            batch_phases.setdefault(engine.name, []).append(
                phases_of(r["phases_ms"], r["elapsed_s"] * 1000.0)
            )
        return r["elapsed_s"] * 1000.0, r["outputs"]

    engines: list[VllmEngine] = []
    pins: dict[str, PinWatch] = {}

    def start(
        name: str, env: dict[str, str] | None = None, *, settle: bool = True, **extra: Any
    ) -> VllmEngine:
        """An engine of ``spec`` and ``extra``; with the connector, ``pins[name]`` watches
        its pinning and ``settle`` waits for it (after a warm-up request unless eager)."""
        t0 = time.monotonic()
        ranks = int(extra.get("tp", args.tp))
        # vLLM 0.26 seeds its block-hash chain randomly per process unless
        # PYTHONHASHSEED is set: the README tells every user to set it
        e = VllmEngine(
            {**spec, **extra},
            env={"PYTHONHASHSEED": "0", **tp_env(ranks), **(env or {})},
            name=name,
            start_timeout=600,
        )
        engines.append(e)
        out[f"start_{name}_s"] = round(time.monotonic() - t0, 1)
        print(f"{name} ready in {out[f'start_{name}_s']} s", flush=True)
        if extra.get("connector") is not None or extra.get("three_keys"):
            # each worker pins the node's pool for DMA in the background (each rank's
            # process says so; vLLM's handler and the connector's may print it twice)
            pins[name] = PinWatch(e.log, ranks, t0)
            if settle:  # loads before it are slower: every such pass measures after it
                if not args.eager:  # then it pins only once the engine ran its first step
                    e.generate(warm_up, 1)
                out[f"pinned_{name}_s"] = pins[name].wait(PIN_WAIT_S)
        return e

    def settled(prefix: str, waited: float = 0.0) -> list[dict[str, float]]:
        """Each rank's counters once the stats files caught up (``waited``: seconds
        already idle since the last request)."""
        time.sleep(max(0.0, STATS_SETTLE_S - waited))
        return rank_stats(prefix, args.tp)

    windows: dict[str, tuple[list[dict[str, float]], list[dict[str, float]], float]] = {}

    # the server as a newcomer starts it: default pool, default ports
    pool = ["--pool-size", args.pool_size] if args.pool_size else []
    server = start_server(extra=["--coordinator-port", "7700", *pool])
    node = server.ready["node"]
    stored = (args.prompts + args.batch * len(set_cs) + len(set_e)) * prompt_bytes
    if stored > int(server.ready.get("pool") or stored):
        server.terminate()
        sys.exit(
            f"the prompts' KV ({stored / 2**30:.1f} GiB) does not fit the server's pool "
            f"({int(server.ready['pool']) / 2**30:.1f} GiB): the first prompts would be "
            "evicted and the warm passes would miss; use fewer --batches or --prompts, or "
            "a larger --pool-size"
        )
    try:
        s1 = str(work / "cold")
        e = start("cold", env={"PEGAFLOW_CONNECTOR_STATS_PATH": s1}, three_keys=True,
                  prefix_caching=False)  # fmt: skip
        try:
            e.generate(warm_up, 1)
            cold_a = [timed(e, p, args.pause) for p in set_a]
            time.sleep(args.pause)
            cold_c_ms, cold_c_out = batch(e, set_c)
            cold_more_out = []
            for more in set_cs[1:]:
                time.sleep(args.pause)
                cold_more_out.append(batch(e, more)[1])
            cold_e_out = batch(e, set_e)[1] if set_e else []
            n = (args.prompts + args.batch * len(set_cs)) * (args.tokens // 16) + 1024 // 16
            n += len(set_e) * ((args.tokens + 1) // 16)
            n *= args.tp  # every rank saves its shard of each block
            print(f"cold counters: {wait_saved(s1, n, timeout=300)}", flush=True)
        finally:
            e.stop()
        if args.diagnose_only:
            diagnose(start, batch, set_c, warm_up, args, out, Path(args.log_dir or work))
            print(json.dumps(out), flush=True)
            return

        e = start("plain", connector=None, log_stats=args.batch_phases)
        try:
            e.generate(warm_up, 1)
            plain_cold = [timed(e, p, args.pause) for p in set_a]
            plain_hit = [timed(e, p, 0.0) for p in set_a]  # back to back, its own cache
            time.sleep(args.pause)
            batch(e, set_c)
            time.sleep(args.pause)
            plain_batch_hit_ms, _ = batch(e, set_c)  # the batch's compute, all in the GPU
        finally:
            e.stop()

        s2 = str(work / "defaults")
        env = {"PEGAFLOW_CONNECTOR_STATS_PATH": s2}
        if args.no_decline:
            env["PEGAFLOW_CONNECTOR_COST_MODEL"] = "0"
        out["cost_model"] = not args.no_decline
        prof = Path(args.log_dir or work) / "restart_profile"
        profiled = {"profile_dir": str(prof)} if args.profile_restart else {}
        if args.profile_restart:
            env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
            out["restart_profiled"] = True
        e = start("defaults", env=env, settle=False, three_keys=True,
                  log_stats=args.batch_phases, **profiled)  # fmt: skip
        try:
            # from its first request, as users meet a restarted engine: no warm-up, no
            # wait for the pinning
            r_start = rank_stats(s2, args.tp) if args.tp > 1 else []
            if args.profile_restart:
                e.call({"op": "start_profile"})
            first_request = time.monotonic()
            restart = [timed(e, p, 0.0) for p in set_a]  # back to back
            restart_end = time.monotonic()
            if args.profile_restart:
                e.call({"op": "stop_profile"}, timeout=300)
            after_c_ms, after_c_out = batch(e, set_c)
            c_cached = batch_cached[e.name]  # later batches write theirs there
            batch_end = time.monotonic()
            out["pinned_defaults_s"] = pins["defaults"].wait(PIN_WAIT_S)
            out["pinning_after_first_request_s"] = pins["defaults"].after(first_request)
            out["restart_during_pinning"] = pins["defaults"].during(restart_end)
            out["batch_during_pinning"] = pins["defaults"].during(batch_end)
            r_pinned = settled(s2, time.monotonic() - batch_end) if args.tp > 1 else []
            # the steady state: the same sets again, the connector's hits once more
            empty_gpu_cache(e)
            steady = [timed(e, p, 0.0) for p in set_a]
            steady_batches = [batch(e, set_c)]
            for more in set_cs[1:]:
                time.sleep(args.pause)
                steady_batches.append(batch(e, more))
            r_steady = settled(s2) if args.tp > 1 else []
            if set_e:
                time.sleep(args.pause)
                e_ms, e_out = batch(e, set_e)
                out["one_token_batch_ms"] = round(e_ms, 1)
                out["one_token_cached_tokens"] = batch_cached[e.name]
                out["one_token_outputs_match"] = e_out == cold_e_out
            batch_cached[e.name] = c_cached
        finally:
            e.stop()  # the engine exits right after its last request
            print(f"defaults counters: {stats(s2)}", flush=True)
            lines = [x for x in e.log if "PegaFlow" in x]
            print("\n".join(lines[-40:]), file=sys.stderr)
        if args.profile_restart and (events := trace_events(prof)):
            out["restart_trace_compare"] = TRACE_SUMMARY.compare(events, 0, -1)
        if args.tp > 1:
            restart_s = (sum(t for t, _, _ in restart) + after_c_ms) / 1000.0
            windows["restart"] = (r_start, r_pinned, restart_s)
            steady_s = sum(t for t, _, _ in steady) + sum(t for t, _ in steady_batches)
            windows["steady"] = (r_pinned, r_steady, steady_s / 1000.0)

        tuned_a: Runs = []
        s3 = str(work / "tuned")
        if not args.skip_tuned:
            e = start("tuned", connector={"local_node": node, "stats_path": s3})
            try:
                e.generate(warm_up, 1)
                r_start = settled(s3) if args.tp > 1 else []
                tuned_a = [timed(e, p, args.pause) for p in set_a]
            finally:
                e.stop()
                print(f"tuned counters: {stats(s3)}", flush=True)
        if args.tp > 1:
            if tuned_a:
                tuned_s = sum(t for t, _, _ in tuned_a) / 1000.0
                windows["tuned"] = (r_start, rank_stats(s3, args.tp), tuned_s)
            cross_tp_pass(start, timed, cold_a, set_a, warm_up, args, work, out)
        compare = {
            "all_at_once": (args.compare_lookahead, "LOAD_LOOKAHEAD_LAYERS"),
            "late_start": (args.compare_early_start, "EARLY_START"),
        }
        for name, (wanted, setting) in compare.items():
            if not wanted:
                continue
            e = start(name, env={f"PEGAFLOW_CONNECTOR_{setting}": "0"}, three_keys=True)
            try:
                e.generate(warm_up, 1)
                time.sleep(args.pause)
                ms_, outs = batch(e, set_c)
                out[f"batch_{name}_ms"] = round(ms_, 1)
                out[f"batch_{name}_outputs_match"] = outs == cold_c_out
            finally:
                e.stop()
        if args.diagnose:
            diagnose(start, batch, set_c, warm_up, args, out, Path(args.log_dir or work))
        if args.skip_kv_oracle:
            pass
        elif args.tp > 1:  # kv_digest reads the KV of one rank's process
            out["kv_oracle"] = "not run: --tp > 1"
        else:
            try:
                kv_oracle_pass(start, args, warm_up, work, out)
            except Exception as err:  # the timed figures are still worth printing
                print(f"KV oracle: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                out["kv_oracle_error"] = f"{type(err).__name__}: {err}"[:2000]
                out["kv_oracle_ok"] = False
    finally:
        server.terminate()
        if args.log_dir:
            for e in engines:
                Path(args.log_dir, f"{e.name}.log").write_text("\n".join(e.log))

    def ms(xs: Runs) -> list[float]:
        return [round(t, 1) for t, _, _ in xs]

    def same(xs: Runs, ref: Runs) -> bool:
        return [o for _, _, o in xs] == [o for _, _, o in ref]

    def cached(xs: Runs) -> list[int]:
        return [c for _, c, _ in xs]

    out["cold_ms"] = ms(cold_a)
    out["plain_cold_ms"] = ms(plain_cold)
    out["plain_local_hit_ms"] = ms(plain_hit)
    out["restart_ms"] = ms(restart)
    out["restart_cached_tokens"] = cached(restart)
    out["steady_ms"] = ms(steady)
    out["steady_cached_tokens"] = cached(steady)
    out.update(restart_figures(out["restart_ms"], out["steady_ms"]))
    out["warm_tuned_ms"] = ms(tuned_a)
    steady_c_outs = [o for _, o in steady_batches]
    out["outputs_match_cold"] = (
        same(restart, cold_a) and same(steady, cold_a)
        and (not tuned_a or same(tuned_a, cold_a))
        and after_c_out == cold_c_out and steady_c_outs[0] == cold_c_out
        and same(plain_cold, cold_a)
    )  # fmt: skip
    out["ttft_cold_ms"] = round(statistics.mean(out["cold_ms"]), 1)
    out["ttft_local_hit_ms"] = round(statistics.mean(out["plain_local_hit_ms"]), 1)
    out["ttft_warm_back_to_back_ms"] = out["steady_mean_ms"]
    if tuned_a:
        out["ttft_warm_tuned_ms"] = round(statistics.mean(out["warm_tuned_ms"]), 1)
        out["default_over_tuned"] = round(out["steady_mean_ms"] / out["ttft_warm_tuned_ms"], 2)
    out["batch_cold_ms"] = round(cold_c_ms, 1)
    out["batch_after_start_ms"] = round(after_c_ms, 1)
    out["batch_steady_all_ms"] = [round(t, 1) for t, _ in steady_batches]
    out["batch_steady_ms"] = round(statistics.mean(t for t, _ in steady_batches), 1)
    out["batches_outputs_match"] = steady_c_outs[1:] == cold_more_out
    batch_bytes = args.batch * args.tokens * kv_bytes_per_token
    out["batch_floor_ms"] = round(floor_ms(batch_bytes, ceilings), 1)
    out["plain_batch_hit_ms"] = round(plain_batch_hit_ms, 1)
    out["batch_cached_tokens"] = batch_cached
    out["batch_x_ceiling"] = round(out["batch_floor_ms"] / out["batch_steady_ms"], 2)
    if batch_phases:
        out["batch_phases_ms"] = batch_phases
    out["back_to_back_over_floor"] = round(out["steady_mean_ms"] / out["ttft_local_hit_ms"], 2)
    if windows:
        rates = {k: rank_load_gbps(b, a, w) for k, (b, a, w) in windows.items()}
        out["ranks_load_gbps"] = {k: [round(x, 1) for x in v] for k, v in rates.items()}
        out["ranks_load_x_ceiling"] = {k: x_ceiling(v, ceilings) for k, v in rates.items()}
        out["ranks_load_job_gbps"] = {
            k: [round(x, 1) for x in rank_job_gbps(b, a)] for k, (b, a, _w) in windows.items()
        }
        out["ranks_load_blocks"] = {
            k: [int(_delta(br, ar, "load_blocks")) for br, ar in zip(b, a, strict=True)]
            for k, (b, a, _w) in windows.items()
        }
    print(json.dumps(out), flush=True)
    if out.get("kv_oracle_ok") is False:
        sys.exit("KV oracle failed: the hit engine's KV is not the KV the cold engine computed")


if __name__ == "__main__":
    main()
