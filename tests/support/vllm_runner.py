"""A real vLLM engine (CPU) in its own process, driven by JSON lines on stdin.

vLLM must be started under ``if __name__ == "__main__":``, so tests and benchmarks run
engines through this script (see :class:`tests.support.vllm_engine.VllmEngine`)::

    python tests/support/vllm_runner.py '<json engine spec>'

The spec: ``model`` (directory with config.json), ``block_size``, ``max_model_len``,
``kv_cache_bytes``, ``tp``, ``prefix_caching`` (vLLM's own), ``connector`` (the
``kv_connector_extra_config`` of PegaKVConnector, or null for no connector),
``three_keys`` (true: the connector with the three documented keys and nothing else;
its settings then come from ``PEGAFLOW_*`` variables only),
``max_num_batched_tokens`` (optional), ``seed``, ``kv_role`` (with ``three_keys``; default
``kv_both``), ``profile_dir`` (vLLM's torch profiler writes its traces there),
``log_stats`` (vLLM's request stats: timings in ``generate``'s answer),
``failure_policy`` (with ``connector``: ``kv_load_failure_policy``, default
``recompute``; null: left to vLLM's default), ``kv_cache_dtype`` (vLLM's
``--kv-cache-dtype``, default ``auto``), ``hybrid_manager`` (false: vLLM's
``--disable-hybrid-kv-cache-manager``).

Prints ``READY`` once the engine is up, then answers each command line with one JSON
line:

* ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": n}`` ->
  ``{"outputs": [[ids...]], "cached": [num_cached_tokens...], "elapsed_s": t}``
  (all prompts in one batch, greedy), with ``log_stats``: ``"phases_ms"``, per prompt
  the ms to its engine-core queueing, first scheduling and first token;
* ``{"op": "ttft", "prompts": [...]}`` -> ``{"ttft_ms": [...], "cached": [...]}``: one
  prompt at a time, ``max_tokens=1``, wall time of each;
* ``{"op": "reset_prefix_cache"}`` -> ``{"ok": true}`` (vLLM's local cache only);
* ``{"op": "kv_digest", "prompt": [ids...]}`` -> ``{"digests": [hex or null, ...]}``: per
  full block of the prompt, the xxh3-64 of that block's KV bytes in every layer (in
  layer order) as the engine's KV cache holds them now (vLLM's prefix cache keeps a
  finished request's blocks), null for a block not in the prefix cache; a KV oracle
  stronger than outputs (:func:`block_digests`; the CPU tests' and the GPU bench's
  oracle).  Needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core in this process)
  and one rank.  With several KV cache groups (vLLM's hybrid KV cache manager) also
  ``"groups"``: per group, its blocks' digests over its own layers, and ``"specs"``:
  each group's spec class (``"digests"`` is group 0's);
* ``{"op": "start_profile"}``, ``{"op": "stop_profile"}`` -> ``{"ok": true}`` (with
  ``profile_dir``; the trace is written at the stop);
* ``{"op": "quit"}``.
"""

from __future__ import annotations

import gc
import inspect
import json
import sys
import time
from collections.abc import Callable
from typing import Any


def _engine(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {}
    if spec.get("three_keys"):  # exactly what the public PegaFlow documents, nothing else
        kw["kv_transfer_config"] = {
            "kv_connector": "PegaKVConnector",
            "kv_role": spec.get("kv_role", "kv_both"),
            "kv_connector_module_path": "pegaflow.connector",
        }
    elif spec.get("connector") is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "PegaKVConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "pegaflow.connector",
            "kv_connector_extra_config": spec["connector"],
        }
        policy = spec.get("failure_policy", "recompute")
        if policy is not None:  # None: vLLM's default
            kw["kv_transfer_config"]["kv_load_failure_policy"] = policy
    if spec.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = int(spec["max_num_batched_tokens"])
    if spec.get("retention_interval") is not None:  # --prefix-cache-retention-interval
        kw["prefix_cache_retention_interval"] = int(spec["retention_interval"])
    if spec.get("hybrid_manager") is False:  # --disable-hybrid-kv-cache-manager
        kw["disable_hybrid_kv_cache_manager"] = True
    if spec.get("profile_dir"):
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": spec["profile_dir"]}
    return LLM(
        model=spec["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=not spec.get("cuda_graphs"),  # vLLM's default compiles, with graphs
        dtype=spec.get("dtype", "bfloat16"),
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        block_size=int(spec.get("block_size", 32)),
        max_model_len=int(spec.get("max_model_len", 2048)),
        kv_cache_memory_bytes=int(spec.get("kv_cache_bytes", 128 << 20)),
        tensor_parallel_size=int(spec.get("tp", 1)),
        enable_prefix_caching=bool(spec.get("prefix_caching", True)),
        seed=int(spec.get("seed", 0)),
        disable_log_stats=not spec.get("log_stats", False),
        **kw,
    )


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    t0 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.monotonic() - t0
    out: dict[str, Any] = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "cached": [int(o.num_cached_tokens or 0) for o in outs],
        "elapsed_s": elapsed,
    }
    phases = [_phases(o, t0) for o in outs]
    if all(phases):
        out["phases_ms"] = phases
    return out


def _phases(output: Any, t0: float) -> list[float] | None:
    """ms from the call's start to when vLLM's engine core queued the request, first
    scheduled it and produced its first token (its monotonic clock, this process's too);
    None unless the engine logs stats (spec ``log_stats``)."""
    m = getattr(output, "metrics", None)
    ts = [getattr(m, k, 0.0) for k in ("queued_ts", "scheduled_ts", "first_token_ts")]
    if not all(ts):
        return None
    return [round((t - t0) * 1e3, 2) for t in ts]


def _kv_digest(llm: Any, prompt: list[int]) -> dict[str, Any]:
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None or not hasattr(core, "scheduler"):
        raise RuntimeError("kv_digest needs VLLM_ENABLE_V1_MULTIPROCESSING=0")
    if core.request_block_hasher is None:
        raise RuntimeError("kv_digest needs vLLM's prefix caching")
    kw: dict[str, Any] = {"block_hasher": core.request_block_hasher}
    if "eos_token_id" in inspect.signature(Request).parameters:  # vLLM before its removal
        kw["eos_token_id"] = None
    req = Request("kv-digest", list(prompt), SamplingParams(max_tokens=1), None, **kw)
    pool = core.scheduler.kv_cache_manager.block_pool
    runner = core.model_executor.driver_worker.worker.model_runner
    groups = core.scheduler.kv_cache_config.kv_cache_groups
    if len(groups) > 1:
        from vllm.model_executor.models.utils import extract_layer_index

        return _group_digests(req.block_hashes, pool, runner.kv_caches, groups, extract_layer_index)
    layers = [t for t in runner.kv_caches if isinstance(t, torch.Tensor)]
    if not layers:
        raise RuntimeError("no KV cache tensors in the model runner")
    ids: list[int | None] = []
    for h in req.block_hashes:
        blocks = pool.get_cached_block(h, [0])
        ids.append(blocks[0].block_id if blocks else None)
    found = iter(block_digests(layers, [b for b in ids if b is not None], pool.num_gpu_blocks))
    digests = [None if b is None else next(found) for b in ids]
    return {"digests": digests, "layers": len(layers)}


def _group_digests(
    hashes: list[Any], pool: Any, kv_caches: list[Any], groups: list[Any],
    layer_index: Callable[[str], int],
) -> dict[str, Any]:  # fmt: skip
    """``kv_digest`` under vLLM's hybrid KV cache manager: per KV cache group, per full
    block, the digest of that group's block over the group's own layers (None: the
    group does not hold it, e.g. a sliding window's block that slid out, or a Mamba
    group's block at a boundary where vLLM kept no state); a Mamba layer's block is its
    state tensors' rows of that block (not the page's padding).
    ``layer_index``: a layer name's index (vLLM's ``extract_layer_index``)."""
    import torch

    # the runner's list holds one cache per layer index, in index order
    order = sorted({layer_index(n) for g in groups for n in g.layer_names})
    per_group: list[list[str | None]] = []
    for gid, group in enumerate(groups):
        caches = [kv_caches[order.index(layer_index(n))] for n in group.layer_names]
        layers = [t for c in caches for t in (c if isinstance(c, list | tuple) else [c])]
        if not all(isinstance(t, torch.Tensor) for t in layers):
            raise RuntimeError(f"group {gid}'s caches are no tensors")
        ids: list[int | None] = []
        for h in hashes:
            blocks = pool.get_cached_block(h, [gid])
            ids.append(blocks[0].block_id if blocks else None)
        found = iter(block_digests(layers, [b for b in ids if b is not None], pool.num_gpu_blocks))
        per_group.append([None if b is None else next(found) for b in ids])
    specs = [type(g.kv_cache_spec).__name__ for g in groups]
    return {"digests": per_group[0], "groups": per_group, "specs": specs}


def block_digests(layers: list[Any], block_ids: list[int], num_blocks: int) -> list[str]:
    """Per id of ``block_ids``, the xxh3-64 (hex) of that block's KV bytes in every
    layer, in layer order: the digest ``kv_digest`` answers.  ``layers``: the KV cache
    tensors, each with a dimension of ``num_blocks`` (the first, or the second after K
    and V), on the CPU or a GPU: each layer's blocks are gathered where the tensor lives
    and copied to host in one piece (a 10,000-token prompt of Llama-3.1-8B: 32 copies of
    40 MB, not 20,000 of 64 KiB)."""
    import torch
    import xxhash

    hashers = [xxhash.xxh3_64() for _ in block_ids]
    if not block_ids:
        return []
    for t in layers:
        if t.shape[0] == num_blocks:
            dim = 0
        elif t.dim() > 1 and t.shape[1] == num_blocks:
            dim = 1
        else:
            raise RuntimeError(f"no block dimension of {num_blocks} in {tuple(t.shape)}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=t.device)
        tiles = t.index_select(dim, idx).movedim(dim, 0).contiguous()
        rows = tiles.view(torch.uint8).reshape(len(block_ids), -1).cpu().numpy()
        for d, row in zip(hashers, rows, strict=True):
            d.update(row)
    return [d.hexdigest() for d in hashers]


def main() -> None:
    spec = json.loads(sys.argv[1])
    llm = _engine(spec)
    out = sys.stdout
    out.write("READY\n")
    out.flush()
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "quit":
                break
            if op == "generate":
                res = _generate(llm, cmd["prompts"], int(cmd.get("max_tokens", 8)))
            elif op == "ttft":
                ttft, cached = [], []
                for p in cmd["prompts"]:
                    r = _generate(llm, [p], 1)
                    ttft.append(r["elapsed_s"] * 1000.0)
                    cached.append(r["cached"][0])
                res = {"ttft_ms": ttft, "cached": cached}
            elif op == "reset_prefix_cache":
                res = {"ok": bool(llm.reset_prefix_cache())}
            elif op == "kv_digest":
                res = _kv_digest(llm, cmd["prompt"])
            elif op == "start_profile":
                llm.start_profile()
                res = {"ok": True}
            elif op == "stop_profile":
                llm.stop_profile()
                res = {"ok": True}
            else:
                res = {"error": f"unknown op {op!r}"}
        except Exception as e:  # report, keep serving
            res = {"error": f"{type(e).__name__}: {e}"}
        out.write("RESULT " + json.dumps(res) + "\n")
        out.flush()
    try:
        llm.llm_engine.engine_core.shutdown()  # stops EngineCore and workers cleanly
    except Exception:
        pass
    del llm
    gc.collect()
    out.write("BYE\n")
    out.flush()


if __name__ == "__main__":
    main()
