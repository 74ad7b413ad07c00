"""Block hashes of a prompt, computed exactly as vLLM's engines compute them.

vLLM chains one hash per full block: ``h_i = H((h_{i-1}, tuple(block_i_tokens), extra))``
with ``h_{-1} = NONE_HASH = H(seed)`` (``vllm.v1.core.kv_cache_utils.hash_block_tokens``
and ``init_none_hash``; ``H`` from ``vllm.utils.hashing``).  The seed is the engines'
``PYTHONHASHSEED`` when set, else (vLLM >= 0.29, cryptographic algorithms only) the
fixed ``"vllm-none-hash"``.  Requests with extra keys (LoRA, multimodal inputs, a
``cache_salt``) hash differently: :func:`hashable` tells the router to route those by
load.  ``tests/e2e/test_router.py`` checks these hashes against vLLM's own functions.

Where vLLM is installed the hash function is vLLM's own (``vllm.utils.hashing``, loaded
by :func:`vllm_hash_function` off the event loop: it imports torch, ~7 s), so a new
vLLM's change of it reaches the router too; the copy below serves routers without vLLM.
Either way :meth:`BlockHasher.check` compares the router's hashes with the engines' own
(their ``BlockStored`` events) and the router stops using a replica's events on a
mismatch (:mod:`~pegaflow.router.kvevents`).
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


def vllm_hash_function(algo: str) -> Callable[[Any], bytes] | None:
    """vLLM's own hash function named ``algo``; ``None`` when vLLM is not importable."""
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except Exception:  # not installed, or broken (a torch mismatch): the copy serves
        return None
    return get_hash_fn_by_name(algo)  # type: ignore[no-any-return]


class BlockHasher:
    """The chained block hashes of token sequences for one engine configuration."""

    def __init__(
        self,
        block_size: int,
        algo: str = "sha256",
        seed: str = "",
        fn: Callable[[Any], bytes] | None = None,
    ) -> None:
        """``seed``: the engines' ``PYTHONHASHSEED``; empty: this process's, else vLLM's
        fixed default (``ValueError`` for the xxhash algorithms, which vLLM then seeds
        randomly per process: no one else can compute their hashes).  ``fn``: the hash
        function (:func:`vllm_hash_function`); ``None``: this module's copy."""
        if block_size <= 0:
            raise ValueError(f"block size must be positive, not {block_size}")
        self.block_size = block_size
        self.algo = algo
        self.own = fn is not None
        """whether the hash function is vLLM's own"""
        self._fn = fn if fn is not None else hash_function(algo)
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

    def check(
        self, parent: bytes | int | None, tokens: Sequence[int], published: Sequence[bytes | int]
    ) -> bool | None:
        """Whether the hashes of ``tokens`` chained from ``parent`` (``None``: the first
        block) equal an engine's ``published`` ones (compared as 64-bit integers when it
        publishes those); ``None`` when this cannot tell (an integer parent, or tokens
        that are not ``len(published)`` full blocks)."""
        if isinstance(parent, int) or len(tokens) != len(published) * self.block_size:
            return None
        h = self.none_hash if parent is None else parent
        bs = self.block_size
        for i, theirs in enumerate(published):
            h = self._fn((h, tuple(tokens[i * bs : (i + 1) * bs]), None))
            if isinstance(theirs, int):
                if int.from_bytes(h, "big") & ((1 << 64) - 1) != theirs:
                    return False
            elif h != theirs:
                return False
        return True


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
