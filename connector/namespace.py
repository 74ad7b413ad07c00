"""Cache namespaces: which engines may share KV blocks.

vLLM's block hashes cover the tokens (and LoRA, multimodal and salt keys) but not the
model or the shape of its KV cache.  Every key the connector writes is therefore
namespaced by everything that changes the bytes of a block: model identity, weights
(dummy weights count with their seed), KV dtype, attention backend / device and KV
layout, block size, layer count, KV heads, head size, TP and PP sizes, and the
fingerprint of the hash seed (``NONE_HASH``), so engines whose hashes cannot agree can
never read each other's blocks.  Where a worker's part of a block goes is the key's
*shard* (:class:`ShardLayout`).

**MLA is stored once** (:class:`ShardLayout`).  With multi-head latent attention every
TP rank holds the same latent KV, so a block has one shard per PP stage: TP rank 0 of
each stage stores it and every rank of the stage loads it.  Its bytes do not depend on
the TP size either, so the TP factor is left out (0): engines of any TP size share them
(unless their weights are dummy: drawn per rank's slice, they differ by TP size).

**Model identity, not model path** (:func:`model_identity`).  Hosts mount one model at
different paths (``/models/llama``, ``/mnt/llama``), so a path in the namespace would
keep them from sharing anything.  The model is keyed, first match wins, on: the
``model_id`` setting; vLLM's ``served_model_name`` when one was given (it differs from
the model path); for a local directory, a digest of its *content*
(:func:`dir_identity`); else the model name itself (a hub repo id; its revision is in
the weights factor).

A directory's content identity is its ``config.json`` (parsed and re-dumped with sorted
keys) plus, unless the weights are dummy, a digest of the weight files vLLM loads (the
top-level ``*.safetensors``, else ``*.bin``, else ``*.pt``, sorted by name): for each,
its name, its size, its safetensors header (tensor names, dtypes, shapes, offsets) and
xxh3 of samples of its bytes: :data:`SAMPLE_CHUNKS` evenly spaced chunks of
:data:`CHUNK_BYTES` (the first one the file's start) and, of a safetensors file, the
first :data:`TENSOR_SAMPLE_BYTES` of up to :data:`TENSOR_SAMPLES` of its tensors.  That
is a few MB read per file, whatever the size of the weights (100+ GB start no slower).
Sampling is safe enough because a fine-tune changes the bytes of each tensor it tuned
throughout, so a sampled tensor start or chunk inside it differs, and a different
model differs in its config, its header or everywhere.  It would *not* catch a change
confined to bytes no sample reads: one tensor edited in a file of more than
:data:`TENSOR_SAMPLES` tensors and missed by the chunks, a few weights patched by hand,
or weights vLLM does not read from these files (e.g. a tokenizer change, which vLLM's
hashes cover anyway as different token ids).  Set ``model_id`` (one name per distinct
model) to override it in such a case, or when the same model is served from copies that
differ in their files (e.g. safetensors on one host, ``.bin`` on another).

**fp8 KV caches** store ``K / k_scale`` and ``V / v_scale``, with one scale per layer
that vLLM reads from the checkpoint (1.0 where it has none) and keeps constant: the
scales are no per-block data, but two checkpoints that differ only in their calibrated
scales write different bytes for the same tokens.  The KV dtype factor therefore names
vLLM's ``kv_cache_dtype`` (``fp8_e4m3`` and ``fp8_e5m2`` never share) and, for a local
directory, :func:`kv_scales_digest`: every scale tensor, read in full.  A hub repo id is
covered by its revision in the weights factor, like the weights themselves.

Pure module: no vLLM import.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import BinaryIO

import xxhash

_SLUG_RE = re.compile(r"[^A-Za-z0-9._-]+")
_NS_VERSION = 2
"""2: the model factor is the model's identity (:func:`model_identity`), not its path"""


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
    """TP size; 0 where the KV does not depend on it (MLA: :meth:`ShardLayout.tp_factor`)"""
    pp_size: int
    page_bytes: int
    """bytes of one block of one layer of one rank, as vLLM sizes it"""
    hash_algo: str
    hash_seed_fingerprint: str
    """hex digest of vLLM's NONE_HASH (the root of the hash chain)"""
    weights: str = ""
    """weights identity when not the model files (e.g. ``dummy:seed=0``), quantization"""
    extra: str = ""
    label: str = ""
    """readable name for the namespace's slug (:attr:`ModelIdentity.name`; never a path);
    not part of the digest"""


def make_namespace(f: NamespaceFactors) -> str:
    """``<label or model slug>.<digest>``: readable, and within the wire's namespace
    alphabet.  The digest covers every factor but the label."""
    factors = asdict(f)
    del factors["label"]
    canon = json.dumps({"v": _NS_VERSION, **factors}, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canon.encode()).hexdigest()[:24]
    base = f.label or f.model.rstrip("/").rsplit("/", 1)[-1] or "model"
    slug = _SLUG_RE.sub("-", base).strip("-.")[:48] or "model"
    return f"{slug}.{digest}"


# ---- model identity ----------------------------------------------------------------

SAMPLE_CHUNKS = 16
"""evenly spaced chunks hashed per weight file (the first at its start)"""
CHUNK_BYTES = 64 * 1024
"""bytes of one such chunk"""
TENSOR_SAMPLES = 64
"""safetensors tensors of a file whose first bytes are hashed (evenly chosen if more)"""
TENSOR_SAMPLE_BYTES = 4096
"""bytes hashed at the start of each sampled tensor"""
MAX_HEADER_BYTES = 100 << 20
"""a larger safetensors header is not one (only the chunks are hashed)"""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
"""weight files, in vLLM's order of preference: the first suffix present is the one read"""
NOT_WEIGHTS = frozenset(
    {"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"}
)
"""files with a weights suffix that vLLM does not load"""
CONFIG_FILES = ("config.json", "params.json")
"""a model's config (``params.json``: Mistral's format), the first present"""


@dataclass(frozen=True)
class ModelIdentity:
    """What the namespace keys the model on, and where that came from."""

    identity: str
    """the namespace's model factor: never a local path (unless nothing else was found)"""
    name: str
    """readable name for the namespace's slug, as path-free as the identity"""
    source: str
    """how the identity was found, in words (for the start line of the log)"""


def model_identity(
    model: str, model_id: str = "", served_name: str = "", dummy_weights: bool = False
) -> ModelIdentity:
    """The identity of vLLM's ``model`` (a local directory or file, or a hub repo id).

    ``model_id``: the setting, wins; ``served_name``: vLLM's ``served_model_name``, used
    when it differs from ``model`` (vLLM defaults it to ``model``); ``dummy_weights``:
    the weights are not read from the files (their seed is a factor of its own), so a
    directory is identified by its config alone.
    """
    if model_id:
        return ModelIdentity(model_id, _basename(model_id), "the model_id setting")
    if served_name and served_name != model:
        return ModelIdentity(
            served_name, _basename(served_name), f"vLLM's served_model_name; model at {model}"
        )
    if os.path.isdir(model) or os.path.isfile(model):
        try:
            ident, name = dir_identity(model, weights=not dummy_weights)
        except OSError as e:
            return ModelIdentity(model, _basename(model), f"its path: {model} unreadable ({e})")
        if ident:
            return ModelIdentity(ident, name, f"the content of {model}")
        return ModelIdentity(
            model, _basename(model), f"its path: no config or weight files in {model}"
        )
    return ModelIdentity(model, _basename(model), "the model name (not a local directory)")


def dir_identity(path: str, weights: bool = True) -> tuple[str, str]:
    """``(identity, name)`` of a model directory from its content, never its path:
    ``config:<xxh3 of its config>`` and, with ``weights``, ``weights:<digest of the
    weight files>`` (:func:`weights_digest`); name: the config's ``model_type``.  A single
    file (e.g. GGUF) is its :func:`file_digest`.  Empty identity: neither was found.
    Raises OSError when a file cannot be read."""
    if os.path.isfile(path):
        h = xxhash.xxh3_128()
        file_digest(path, h)
        return f"weights:{h.hexdigest()}", "model"
    parts, name = [], "model"
    for fname in CONFIG_FILES:
        cfg_path = os.path.join(path, fname)
        if os.path.isfile(cfg_path):
            with open(cfg_path, "rb") as fh:
                raw = fh.read()
            try:
                cfg = json.loads(raw)
                canon = json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()
            except ValueError:  # not JSON: its bytes, as they are
                cfg, canon = None, raw
            if isinstance(cfg, Mapping) and isinstance(cfg.get("model_type"), str):
                name = cfg["model_type"] or name
            parts.append(f"config:{xxhash.xxh3_128(canon).hexdigest()}")
            break
    if weights:
        files = weight_files(path)
        if files:
            parts.append(f"weights:{weights_digest(path, files)}")
    return ";".join(parts), name


def weight_files(path: str) -> list[str]:
    """The weight files vLLM loads from directory ``path``: the top-level files of the
    first :data:`WEIGHT_SUFFIXES` present (minus :data:`NOT_WEIGHTS`), sorted by name."""
    names = sorted(e.name for e in os.scandir(path) if e.is_file() and e.name not in NOT_WEIGHTS)
    for suffix in WEIGHT_SUFFIXES:
        found = [n for n in names if n.endswith(suffix)]
        if found:
            return found
    return []


def weights_digest(path: str, files: Sequence[str]) -> str:
    """xxh3 of ``files`` (names relative to ``path``), each with its name and
    :func:`file_digest`."""
    h = xxhash.xxh3_128()
    for name in files:
        h.update(name.encode() + b"\0")
        file_digest(os.path.join(path, name), h)
    return h.hexdigest()


def file_digest(path: str, h: xxhash.xxh3_128) -> None:
    """Feed ``h`` one weight file's size, its safetensors header (if it is one) and
    samples of its bytes (see the module's docstring for why samples are enough)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        for off in sample_offsets(size):
            fh.seek(off)
            h.update(fh.read(CHUNK_BYTES))
        for off, n in _tensor_samples(fh, size, h):
            fh.seek(off)
            h.update(fh.read(n))


def sample_offsets(size: int) -> list[int]:
    """Offsets of the :data:`SAMPLE_CHUNKS` chunks sampled in a file of ``size`` bytes:
    evenly spaced from its start to its end (one chunk for a small file)."""
    last = max(0, size - CHUNK_BYTES)
    if last == 0:
        return [0]
    n = SAMPLE_CHUNKS
    return sorted({round(i * last / (n - 1)) for i in range(n)})


def _tensor_samples(fh: BinaryIO, size: int, h: xxhash.xxh3_128) -> list[tuple[int, int]]:
    """A safetensors file's header fed to ``h``, and the ``(offset, length)`` of the
    tensor starts to sample; nothing when the file is no safetensors file."""
    found = _safetensors_header(fh, size)
    if found is None:
        return []
    raw, spans = found
    h.update(raw)
    picked = [(off, min(n, TENSOR_SAMPLE_BYTES)) for _, off, n in spans]
    if len(picked) > TENSOR_SAMPLES:
        step = len(picked) / TENSOR_SAMPLES
        picked = [picked[int(i * step)] for i in range(TENSOR_SAMPLES)]
    return picked


def _safetensors_header(fh: BinaryIO, size: int) -> tuple[bytes, list[tuple[str, int, int]]] | None:
    """``(raw header, [(tensor name, file offset, bytes)...] sorted by name)`` of a
    safetensors file; None when the file is no safetensors file."""
    fh.seek(0)
    head = fh.read(8)
    if len(head) < 8:
        return None
    n = int.from_bytes(head, "little")
    if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
        return None
    raw = fh.read(n)
    try:
        header = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    spans = []
    for name in sorted(k for k in header if k != "__metadata__"):
        t = header[name]
        offs = t.get("data_offsets") if isinstance(t, dict) else None
        if isinstance(offs, list) and len(offs) == 2 and all(isinstance(x, int) for x in offs):
            begin, end = offs
            if 0 <= begin < end:
                spans.append((name, 8 + n + begin, end - begin))
    return raw, spans


KV_SCALE_RE = re.compile(r"(?:^|\.)(?:k|v|kv)_scale$|(?:^|\.)[kv]_proj\.output_scale$")
"""checkpoint tensors holding a layer's fp8 KV cache scales (vLLM's names, and the
``k_proj``/``v_proj`` output scales of compressed-tensors checkpoints it maps onto them)"""


def kv_scales_digest(path: str) -> str:
    """xxh3 of the KV cache scales (:data:`KV_SCALE_RE`) a model directory's safetensors
    weights hold: names and bytes, all of them (each is a scalar or one per head, unlike
    the weights, which are only sampled).  An fp8 KV cache stores ``K / k_scale``, so two
    checkpoints that differ only in their calibrated scales write different bytes for
    the same tokens.  Empty: ``path`` is no directory, or no such tensor was found.
    Raises OSError when a file cannot be read."""
    if not os.path.isdir(path):
        return ""
    h = xxhash.xxh3_128()
    found = False
    for name in weight_files(path):
        if not name.endswith(".safetensors"):
            continue
        fpath = os.path.join(path, name)
        with open(fpath, "rb") as fh:
            header = _safetensors_header(fh, os.fstat(fh.fileno()).st_size)
            for tensor, off, n in header[1] if header else []:
                if KV_SCALE_RE.search(tensor):
                    fh.seek(off)
                    h.update(tensor.encode() + b"\0" + fh.read(n))
                    found = True
    return h.hexdigest() if found else ""


def _basename(model: str) -> str:
    return model.rstrip("/").rsplit("/", 1)[-1] or "model"


@dataclass(frozen=True)
class ShardLayout:
    """How an engine's ranks divide each block into shards: the one place that decides
    which rank stores and loads which shard."""

    tp_size: int = 1
    pp_size: int = 1
    replicated: bool = False
    """every TP rank holds the same KV (MLA's latent KV): one shard per PP stage"""

    @property
    def shards(self) -> int:
        """Shards per block: a block is a hit only where all of them are stored."""
        return self.pp_size if self.replicated else self.tp_size * self.pp_size

    def tp_factor(self, dummy_weights: bool = False) -> int:
        """The namespace's TP factor: 0 where the KV does not depend on the TP size
        (replicated, with the weights read from files: dummy weights are drawn per rank's
        slice, so at another TP size they are another model)."""
        return 0 if self.replicated and not dummy_weights else self.tp_size

    def rank(self, tp_rank: int, pp_rank: int) -> int:
        """A worker's global rank within the engine (PP-major)."""
        return pp_rank * self.tp_size + tp_rank

    def shard(self, tp_rank: int, pp_rank: int) -> int:
        """The shard a worker stores and loads: its rank, or its PP stage where replicated."""
        return pp_rank if self.replicated else self.rank(tp_rank, pp_rank)

    def saves(self, tp_rank: int) -> bool:
        """Whether a worker stores its shard: where replicated, TP rank 0 only (the others
        hold the same bytes)."""
        return not self.replicated or tp_rank == 0


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


def group_keys(hashes: Sequence[bytes], groups: int) -> list[bytes]:
    """The storage keys of a request's blocks in every KV cache group, interleaved:
    block ``i`` of group ``g`` is key ``i * groups + g``.

    vLLM's hybrid KV cache manager gives each group (full attention, each sliding
    window) its own block table over the same token blocks, so one block hash names
    ``groups`` stored blocks.  Group 0 keeps the hash itself (a single-group engine's
    keys are its block hashes); group ``g > 0`` stores under a 32-byte blake2b of the
    hash and ``g``.  A prefix of whole positions of this list is a hit in every group.
    """
    if groups == 1:
        return list(hashes)
    out: list[bytes] = []
    for h in hashes:
        out.append(h)
        for g in range(1, groups):
            out.append(hashlib.blake2b(h, digest_size=32, salt=g.to_bytes(16, "little")).digest())
    return out
