"""Cache namespaces: which engines may share KV blocks.

vLLM's block hashes cover the tokens (and LoRA, multimodal and salt keys) but not the
model or the shape of its KV cache.  Every key the connector writes is therefore
namespaced by everything that changes the bytes of a block: model identity, weights
(dummy weights count with their seed), KV dtype, attention backend / device and KV
layout, block size, layer count, KV heads, head size, TP and PP sizes, and the
fingerprint of the hash seed (``NONE_HASH``), so engines whose hashes cannot agree can
never read each other's blocks.  The rank of the worker is the key's *shard*.

Pure module: no vLLM import.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

_SLUG_RE = re.compile(r"[^A-Za-z0-9._-]+")
_NS_VERSION = 1


@dataclass(frozen=True)
class NamespaceFactors:
    """Everything that must match for two engines to share a block."""

    model: str
    dtype: str
    kv_dtype: str
    device: str
    layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int
    pp_size: int
    page_bytes: int
    """bytes of one block of one layer of one rank, as vLLM sizes it"""
    hash_algo: str
    hash_seed_fingerprint: str
    """hex digest of vLLM's NONE_HASH (the root of the hash chain)"""
    weights: str = ""
    """weights identity when not the model files (e.g. ``dummy:seed=0``), quantization"""
    extra: str = ""

    @property
    def world_size(self) -> int:
        """Ranks (shards) that each hold a part of every block."""
        return self.tp_size * self.pp_size


def make_namespace(f: NamespaceFactors) -> str:
    """``<model slug>.<digest>``: readable, and within the wire's namespace alphabet."""
    canon = json.dumps({"v": _NS_VERSION, **asdict(f)}, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canon.encode()).hexdigest()[:24]
    base = f.model.rstrip("/").rsplit("/", 1)[-1] or "model"
    slug = _SLUG_RE.sub("-", base).strip("-.")[:48] or "model"
    return f"{slug}.{digest}"


def shard_of(tp_rank: int, pp_rank: int, tp_size: int) -> int:
    """The shard number of a worker: its global rank within the engine (PP-major)."""
    return pp_rank * tp_size + tp_rank


@dataclass(frozen=True)
class HashStability:
    """Whether block hashes of this engine equal those of another process."""

    stable: bool
    reason: str


CRYPTO_HASH_ALGOS = frozenset({"sha256", "sha256_cbor"})


def hash_stability(
    algo: str, pythonhashseed: str | None, fixed_default_seed: bool
) -> HashStability:
    """Decide whether hashes are reproducible across processes.

    ``fixed_default_seed``: this vLLM derives the hash-chain root from a fixed seed for
    cryptographic algorithms when ``PYTHONHASHSEED`` is unset (vLLM >= 0.29).
    """
    if pythonhashseed is not None and pythonhashseed != "random":
        return HashStability(True, f"PYTHONHASHSEED is set ({algo})")
    if algo in CRYPTO_HASH_ALGOS and fixed_default_seed:
        return HashStability(True, f"{algo} with vLLM's fixed default seed")
    if algo not in CRYPTO_HASH_ALGOS:
        why = f"prefix_caching_hash_algo={algo!r} seeds its hash chain randomly per process"
    else:
        why = "this vLLM seeds the hash chain randomly per process"
    return HashStability(
        False,
        f"{why}; blocks saved by this engine can only be found by this same process. "
        "Set the same PYTHONHASHSEED for every replica (and restart) to share the cache.",
    )


def block_hashes_bytes(hashes: Sequence[object]) -> list[bytes]:
    """:func:`block_hash_bytes` of each hash; vLLM's own ``bytes`` of at most 64 bytes
    pass as they are, checked in bulk (a 10k-token prefix is hundreds of blocks)."""
    out = list(hashes)
    if out and set(map(type, out)) == {bytes}:
        lens = set(map(len, out))
        if 0 < min(lens) and max(lens) <= 64:
            return out  # type: ignore[return-value]
    return [block_hash_bytes(h) for h in out]


def block_hash_bytes(h: object) -> bytes:
    """A block hash as bytes, deterministically, whatever type this vLLM uses.

    vLLM >= 0.10 uses ``bytes`` (sha256 digests); older releases used ints or
    ``BlockHash(hash_value=..., ...)`` named tuples.  Hashes longer than 64 bytes (the
    wire's limit) are folded with sha256.
    """
    if isinstance(h, bytes | bytearray | memoryview):
        b = bytes(h)
    elif isinstance(h, int) and not isinstance(h, bool):
        n = max(1, (h.bit_length() + 8) // 8)
        b = h.to_bytes(n, "big", signed=True)
    elif hasattr(h, "hash_value"):
        return block_hash_bytes(h.hash_value)
    elif isinstance(h, str):
        b = h.encode()
    else:
        raise TypeError(f"unsupported block hash type {type(h).__name__}")
    if not b or len(b) > 64:
        b = hashlib.sha256(b).digest()
    return b
