"""The namespace keys the model on its identity, never on the path it is mounted at.

Two hosts that mount one model at different paths (``/models/llama``, ``/mnt/llama``)
must share its blocks; a fine-tune, another config or other weight files must not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from pegaflow.connector.namespace import (
    CHUNK_BYTES,
    SAMPLE_CHUNKS,
    NamespaceFactors,
    dir_identity,
    kv_scales_digest,
    make_namespace,
    model_identity,
    sample_offsets,
    weight_files,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}


def write_safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    """A safetensors file (header length, JSON header, data) of raw byte tensors."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [off, off + len(data)]}
        off += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(tensors.values()))


def model_dir(root: Path, config: dict[str, Any] | None = None) -> Path:
    """A model with two weight shards, each far larger than its samples."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config or CONFIG, indent=2))
    pattern = bytes(range(251)) * 2400
    for i in range(2):
        tensors = {
            f"layers.{i}.{t}": pattern[i * 7 + j : i * 7 + j + 600_000]
            for j, t in enumerate(("q", "k", "v", "o"))
        }
        write_safetensors(root / f"model-0000{i + 1}-of-00002.safetensors", tensors)
    (root / "tokenizer.json").write_text("{}")
    return root


def ident(path: Path, **kw: Any) -> str:
    return model_identity(str(path), **kw).identity


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    return model_dir(tmp_path / "models" / "llama")


def test_the_same_model_at_another_path_is_the_same_model(llama: Path, tmp_path: Path) -> None:
    copy = tmp_path / "mnt" / "Llama-3-copy"
    shutil.copytree(llama, copy)
    a, b = model_identity(str(llama)), model_identity(str(copy))
    assert a.identity == b.identity and a.name == b.name == "llama"
    assert str(tmp_path) not in a.identity and "llama" not in a.identity
    assert a.identity.startswith("config:") and ";weights:" in a.identity
    assert "content of" in a.source
    # as vLLM is given them: a trailing slash, a relative path
    assert ident(Path(f"{copy}/")) == a.identity
    assert model_identity(os.path.relpath(copy)).identity == a.identity


def test_config_is_compared_as_data(llama: Path) -> None:
    before = ident(llama)
    (llama / "config.json").write_text(json.dumps(dict(reversed(CONFIG.items()))))
    assert ident(llama) == before  # key order and whitespace are no difference
    (llama / "config.json").write_text(json.dumps({**CONFIG, "hidden_size": 65}))
    assert ident(llama) != before


def test_a_changed_byte_that_a_sample_reads_is_another_model(llama: Path) -> None:
    before = ident(llama)
    shard = llama / "model-00002-of-00002.safetensors"
    size = shard.stat().st_size
    offsets = sample_offsets(size)
    assert len(offsets) == SAMPLE_CHUNKS and offsets[0] == 0
    assert offsets[-1] == size - CHUNK_BYTES  # evenly spaced up to the file's end
    flip(shard, offsets[7] + 100)  # inside an evenly spaced chunk
    assert ident(llama) != before


def tensor_starts(shard: Path) -> list[int]:
    """The file offsets of a safetensors file's tensors."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return sorted(8 + n + t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")


def unsampled(shard: Path, offset: int) -> bool:
    """Whether no evenly spaced chunk reads ``offset``."""
    return not any(o <= offset < o + CHUNK_BYTES for o in sample_offsets(shard.stat().st_size))


def test_a_fine_tuned_tensor_is_seen_at_its_start(llama: Path) -> None:
    """Each tensor's first bytes are sampled: a tuned tensor differs there."""
    before = ident(llama)
    shard = llama / "model-00001-of-00002.safetensors"
    start = next(t + 10 for t in tensor_starts(shard) if unsampled(shard, t + 10))
    flip(shard, start)
    assert ident(llama) != before


def test_a_byte_no_sample_reads_is_not_seen(llama: Path) -> None:
    """The documented limit: identity is sampled, not a hash of every byte (set
    ``model_id`` when models differ only there)."""
    before = ident(llama)
    shard = llama / "model-00001-of-00002.safetensors"
    mid = [t + 300_000 for t in tensor_starts(shard)]  # far from any tensor's start
    flip(shard, next(o for o in mid if unsampled(shard, o)))
    assert ident(llama) == before


def test_renamed_resized_or_other_weight_files_are_another_model(llama: Path) -> None:
    before = ident(llama)
    shard = llama / "model-00002-of-00002.safetensors"
    shard.rename(llama / "model-00002-of-00002x.safetensors")
    assert ident(llama) != before
    (llama / "model-00002-of-00002x.safetensors").rename(shard)
    assert ident(llama) == before
    with open(shard, "ab") as fh:
        fh.write(b"\0")
    assert ident(llama) != before


def test_the_weight_files_are_those_vllm_loads(llama: Path) -> None:
    before = ident(llama)
    (llama / "training_args.bin").write_bytes(b"not weights")
    (llama / "pytorch_model.bin").write_bytes(b"vLLM prefers the safetensors")
    (llama / "original").mkdir()
    (llama / "original" / "consolidated.00.pth").write_bytes(b"not read by vLLM")
    (llama / "README.md").write_text("hello")
    assert ident(llama) == before
    assert weight_files(str(llama)) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    for p in llama.glob("*.safetensors"):
        p.unlink()
    assert weight_files(str(llama)) == ["pytorch_model.bin"]  # training_args.bin is not


def test_dummy_weights_are_identified_by_the_config(tmp_path: Path) -> None:
    """With ``load_format="dummy"`` no weight file is read (the seed is a factor of its
    own); the config stands for the model."""
    a = model_dir(tmp_path / "a")
    b = tmp_path / "b"
    b.mkdir()
    (b / "config.json").write_text(json.dumps(CONFIG))  # config only, as the tests use
    assert ident(a, dummy_weights=True) == ident(b, dummy_weights=True)
    assert ident(a, dummy_weights=True).startswith("config:")
    assert ident(a) != ident(a, dummy_weights=True)
    assert dir_identity(str(b)) == (ident(a, dummy_weights=True), "llama")


def test_precedence_model_id_then_served_name_then_content(llama: Path) -> None:
    content = ident(llama)
    assert ident(llama, served_name=str(llama)) == content  # vLLM's default: the path
    served = model_identity(str(llama), served_name="meta-llama/Llama-3.1-8B")
    assert served.identity == "meta-llama/Llama-3.1-8B" and served.name == "Llama-3.1-8B"
    assert "served_model_name" in served.source
    chosen = model_identity(str(llama), model_id="llama-ft-7", served_name="x")
    assert (chosen.identity, chosen.source) == ("llama-ft-7", "the model_id setting")


def test_a_hub_repo_id_is_its_own_identity(tmp_path: Path) -> None:
    hub = model_identity("Qwen/Qwen2-0.5B")
    assert (hub.identity, hub.name) == ("Qwen/Qwen2-0.5B", "Qwen2-0.5B")
    empty = tmp_path / "empty"
    empty.mkdir()  # nothing to identify it by: its path, said so
    fallback = model_identity(str(empty))
    assert fallback.identity == str(empty) and "its path" in fallback.source


def test_the_label_names_the_namespace_but_is_no_factor() -> None:
    f = NamespaceFactors(
        model="config:ab;weights:cd", dtype="bfloat16", kv_dtype="bfloat16/auto",
        device="cpu", layout="LBHNC", block_size=16, num_layers=2, num_kv_heads=2,
        head_size=32, tp_size=1, pp_size=1, page_bytes=8192, hash_algo="sha256",
        hash_seed_fingerprint="abcd", label="llama",
    )  # fmt: skip
    ns = make_namespace(f)
    assert ns.startswith("llama.")
    assert ns.split(".")[1] == make_namespace(dataclasses.replace(f, label="x")).split(".")[1]
    assert make_namespace(dataclasses.replace(f, model="config:ab;weights:ce")) != ns


# ---- through the connector -----------------------------------------------------------


def connector_namespace(
    model: str,
    caplog: pytest.LogCaptureFixture,
    cache_dtype: str = "auto",
    load_format: str = "dummy",
    **mc: Any,
) -> str:
    """The namespace a scheduler-side connector computes for ``model`` (dummy weights
    unless ``load_format`` says otherwise)."""
    pytest.importorskip("vllm")
    from pegaflow.connector import PegaKVConnector
    from pegaflow.connector.compat import KVConnectorRole
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from tests.support.connector_fakes import FakeCluster, kv_cache_config, vllm_config

    init_none_hash(get_hash_fn_by_name("sha256"))
    vc = vllm_config()
    vc.model_config = SimpleNamespace(model=model, dtype="bfloat16", seed=0, **mc)
    vc.cache_config.cache_dtype = cache_dtype
    vc.load_config.load_format = load_format
    cluster = FakeCluster()
    with mock.patch.object(PegaKVConnector, "_make_client", lambda self: cluster):
        conn = PegaKVConnector(vc, KVConnectorRole.SCHEDULER, kv_cache_config())
    log = logging.getLogger("pegaflow.connector")  # it does not propagate (vLLM's handler)
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, "pegaflow.connector"):
            ns = conn._compute_namespace()
    finally:
        log.removeHandler(caplog.handler)
        conn.shutdown()
    assert ns
    return ns


def test_engines_with_the_model_at_other_paths_share_a_namespace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dirs = []
    for where in ("models/llama", "mnt/tiny-llama"):
        d = tmp_path / where
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(CONFIG))
        dirs.append(str(d))
    a = connector_namespace(dirs[0], caplog)
    assert a == connector_namespace(dirs[1], caplog)
    assert a.startswith("llama.")
    line = next(r.getMessage() for r in caplog.records if "PegaFlow namespace" in r.getMessage())
    assert line.startswith(f"PegaFlow namespace {a} for model identity config:")
    assert f"the content of {dirs[0]}" in line and "set model_id to override" in line
    assert "NamespaceFactors(model='config:" in line  # every factor, to compare engines
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**CONFIG, "hidden_size": 128}))
    assert connector_namespace(str(other), caplog) != a
    served = connector_namespace(dirs[0], caplog, served_model_name="llama-3")
    assert served != a and served == connector_namespace(
        dirs[1], caplog, served_model_name="llama-3"
    )


def fp8_checkpoint(root: Path, k_scale: float, extra: dict[str, bytes] | None = None) -> Path:
    """A model directory whose layers carry fp8 KV cache scales (and ``extra`` tensors)."""
    import struct

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    tensors = {"layers.0.q": bytes(range(200)) * 3000, **(extra or {})}
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.attn.k_scale"] = struct.pack("<f", k_scale)
        tensors[f"model.layers.{i}.self_attn.attn.v_scale"] = struct.pack("<f", 0.5)
    write_safetensors(root / "model.safetensors", tensors)
    return root


def test_kv_scales_digest_reads_every_scale_and_nothing_else(tmp_path: Path) -> None:
    """The fp8 scales are read in full (they fall between the weights' samples): a
    checkpoint recalibrated to other scales gets another digest; a path, other weights
    of the same names or a directory without scales do not change it or have none."""
    a = kv_scales_digest(str(fp8_checkpoint(tmp_path / "a", 0.25)))
    assert a and a == kv_scales_digest(str(fp8_checkpoint(tmp_path / "mnt" / "a", 0.25)))
    assert kv_scales_digest(str(fp8_checkpoint(tmp_path / "b", 0.125))) != a
    other = fp8_checkpoint(tmp_path / "c", 0.25, {"layers.1.o": b"x" * 100})
    assert kv_scales_digest(str(other)) == a
    assert kv_scales_digest(str(model_dir(tmp_path / "plain"))) == ""
    assert kv_scales_digest(str(tmp_path / "missing")) == ""


def test_fp8_caches_of_other_scales_or_dtypes_never_share(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two checkpoints differing only in a k_scale, served under one name (so their
    identity is that name: no weights read), write other fp8 bytes: their namespaces
    differ; so do fp8_e4m3 and fp8_e5m2 of one checkpoint; a bf16 cache of it is keyed
    as before (no scale factor)."""
    a = str(fp8_checkpoint(tmp_path / "a", 0.25))
    b = str(fp8_checkpoint(tmp_path / "b", 0.125))
    real = {"load_format": "safetensors", "served_model_name": "llama-fp8"}
    e4m3 = connector_namespace(a, caplog, "fp8_e4m3", **real)
    assert "kv_dtype='bfloat16/fp8_e4m3/scales:" in caplog.text
    assert connector_namespace(b, caplog, "fp8_e4m3", **real) != e4m3
    assert connector_namespace(a, caplog, "fp8_e5m2", **real) != e4m3
    assert "/scales:" not in connector_namespace(a, caplog, **real)
    line = next(r.getMessage() for r in reversed(caplog.records) if "namespace" in r.getMessage())
    assert "kv_dtype='bfloat16/auto'" in line
