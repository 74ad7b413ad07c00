"""Block hashes of a prompt, computed exactly as vLLM's engines compute them.

vLLM chains one hash per full block: ``h_i = H((h_{i-1}, tuple(block_i_tokens), extra))``
with ``h_{-1} = NONE_HASH = H(seed)`` (``vllm.v1.core.kv_cache_utils.hash_block_tokens``
and ``init_none_hash``; ``H`` from ``vllm.utils.hashing``).  The seed is the engines'
``PYTHONHASHSEED`` when set, else (vLLM >= 0.29, cryptographic algorithms only) the
fixed ``"vllm-none-hash"``.  Requests with extra keys (LoRA, multimodal inputs, a
``cache_salt``) hash differently: :func:`hashable` tells the router to route those by
load.  ``tests/e2e/test_router.py`` checks these hashes against vLLM's own functions.

Pure module: no vLLM import (the router does not need vLLM installed).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
"""vLLM's ``--prefix-caching-hash-algo`` values"""
DEFAULT_SEED = "vllm-none-hash"
"""vLLM's ``DEFAULT_NONE_HASH_SEED`` (cryptographic algorithms, ``PYTHONHASHSEED`` unset)"""


def _cbor(obj: Any) -> bytes:
    try:
        import cbor2
    except ImportError:  # pragma: no cover - cbor2 comes with vLLM
        raise ValueError("the *_cbor hash algorithms need the cbor2 package") from None
    return bytes(cbor2.dumps(obj, canonical=True))


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's hash function named ``algo`` (one of :data:`ALGOS`); else ``ValueError``."""
    if algo == "sha256":
        return lambda o: hashlib.sha256(_pickle(o)).digest()
    if algo == "sha256_cbor":
        return lambda o: hashlib.sha256(_cbor(o)).digest()
    if algo == "xxhash":
        return lambda o: xxhash.xxh3_128_digest(_pickle(o))
    if algo == "xxhash_cbor":
        return lambda o: xxhash.xxh3_128_digest(_cbor(o))
    raise ValueError(f"unknown hash algorithm {algo!r} (one of {', '.join(ALGOS)})")


class BlockHasher:
    """The chained block hashes of token sequences for one engine configuration."""

    def __init__(self, block_size: int, algo: str = "sha256", seed: str = "") -> None:
        """``seed``: the engines' ``PYTHONHASHSEED``; empty: this process's, else vLLM's
        fixed default (``ValueError`` for the xxhash algorithms, which vLLM then seeds
        randomly per process: no one else can compute their hashes)."""
        if block_size <= 0:
            raise ValueError(f"block size must be positive, not {block_size}")
        self.block_size = block_size
        self.algo = algo
        self._fn = hash_function(algo)
        if not seed:
            seed = os.environ.get("PYTHONHASHSEED", "")
        if not seed:
            if algo.startswith("xxhash"):
                raise ValueError(
                    f"{algo} hashes are seeded randomly per engine unless PYTHONHASHSEED is "
                    "set: start the engines with one and give the router the same "
                    "(--router-hash-seed)"
                )
            seed = DEFAULT_SEED
        self.seed = seed
        self.none_hash = self._fn(seed)

    def hashes(self, tokens: Sequence[int], limit: int | None = None) -> list[bytes]:
        """The hashes of every full block of ``tokens`` (at most ``limit`` of them)."""
        n = len(tokens) // self.block_size
        if limit is not None:
            n = min(n, limit)
        out: list[bytes] = []
        parent = self.none_hash
        bs = self.block_size
        for i in range(n):
            parent = self._fn((parent, tuple(tokens[i * bs : (i + 1) * bs]), None))
            out.append(parent)
        return out


#: Request fields that add extra keys to vLLM's block hashes.
_EXTRA_KEY_FIELDS = ("cache_salt", "lora_request", "multi_modal_data", "prompt_embeds")


def hashable(body: dict[str, Any]) -> bool:
    """Whether the router's hashes of ``body``'s prompt can equal the engines' (no
    field that adds extra keys to vLLM's hashes, no image or audio part)."""
    if any(body.get(k) for k in _EXTRA_KEY_FIELDS):
        return False
    for msg in body.get("messages") or ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") not in (None, "text") for p in content
        ):
            return False
    return True
