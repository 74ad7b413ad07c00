"""Connector settings (extra config + PEGAFLOW_* env), namespaces, hash stability."""

from __future__ import annotations

import dataclasses

import pytest
from pegaflow.connector.namespace import (
    NamespaceFactors,
    block_hash_bytes,
    hash_stability,
    make_namespace,
    shard_of,
)
from pegaflow.connector.settings import ConnectorSettings

from pegaflow.wire import check_namespace


def test_defaults_and_precedence() -> None:
    s = ConnectorSettings.load({}, env={})
    assert s.mode == "read_write" and s.can_load and s.can_save
    assert s.coordinators == ["127.0.0.1:7700"]
    env = {
        "PEGAFLOW_CLIENT_COORDINATORS": "a:1,b:2",
        "PEGAFLOW_CLIENT_LOCAL_NODE": "from-client",
        "PEGAFLOW_CONNECTOR_LOCAL_NODE": "from-connector",
        "PEGAFLOW_CONNECTOR_MODE": "load_only",
        "PEGAFLOW_SECURITY_TOKEN": "sekret",
        "PEGAFLOW_CONNECTOR_LOOKUP_TIMEOUT_S": "0.2",
        "PEGAFLOW_CONNECTOR_MAX_STAGING_BYTES": "64MiB",
        "PEGAFLOW_CONNECTOR_SAVE_DECODE_BLOCKS": "yes",
    }
    s = ConnectorSettings.load({}, env=env)
    assert s.coordinators == ["a:1", "b:2"]
    assert s.local_node == "from-connector"
    assert s.mode == "load_only" and s.can_load and not s.can_save
    assert s.token == "sekret" and s.redacted()["token"] == "***"
    assert s.lookup_timeout_s == 0.2
    assert s.max_staging_bytes == 64 << 20
    assert s.save_decode_blocks is True
    s = ConnectorSettings.load(
        {"coordinators": ["c:3"], "local_node": "x", "mode": "save_only"}, env=env
    )
    assert s.coordinators == ["c:3"] and s.local_node == "x" and s.can_save and not s.can_load


@pytest.mark.parametrize(
    "extra",
    [
        {"moed": "read_write"},
        {"mode": "sometimes"},
        {"lookup_timeout_s": 0},
        {"lookup_timeout_s": "soon"},
        {"coordinators": []},
        {"chunk_bytes": "1.5.2"},
        {"save_decode_blocks": "perhaps"},
    ],
)
def test_bad_settings_are_rejected(extra: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ConnectorSettings.load(extra, env={})


def factors(**kw: object) -> NamespaceFactors:
    base = NamespaceFactors(
        model="/models/Llama-3.1-8B/",
        dtype="bfloat16",
        kv_dtype="bfloat16/auto",
        device="cpu",
        layout="LBHNC",
        block_size=32,
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        tp_size=1,
        pp_size=1,
        page_bytes=8192,
        hash_algo="sha256",
        hash_seed_fingerprint="abcd",
    )
    return dataclasses.replace(base, **kw)


def test_namespace_is_stable_readable_and_valid_on_the_wire() -> None:
    ns = make_namespace(factors())
    assert ns == make_namespace(factors())
    assert ns.startswith("Llama-3.1-8B.")
    assert check_namespace(ns) == ns
    weird = make_namespace(factors(model="hf://org/ä weird model name!!" + "x" * 300))
    assert check_namespace(weird) == weird


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"dtype": "float16"},
        {"kv_dtype": "fp8/fp8"},
        {"device": "cuda"},
        {"layout": "NHD"},
        {"block_size": 64},
        {"num_layers": 3},
        {"num_kv_heads": 4},
        {"head_size": 64},
        {"tp_size": 2},
        {"pp_size": 2},
        {"page_bytes": 4096},
        {"hash_algo": "sha256_cbor"},
        {"hash_seed_fingerprint": "ffff"},
        {"weights": "dummy:seed=1"},
        {"extra": "rev2"},
    ],
)
def test_every_factor_changes_the_namespace(change: dict[str, object]) -> None:
    assert make_namespace(factors(**change)) != make_namespace(factors())


def test_shards_and_world_size() -> None:
    assert factors(tp_size=2, pp_size=2).world_size == 4
    assert [shard_of(t, p, 2) for p in range(2) for t in range(2)] == [0, 1, 2, 3]


def test_hash_stability() -> None:
    assert hash_stability("sha256", None, True).stable
    assert hash_stability("sha256_cbor", None, True).stable
    assert not hash_stability("sha256", None, False).stable  # vLLM < 0.29
    assert not hash_stability("xxhash", None, True).stable
    assert hash_stability("xxhash", "42", True).stable
    assert not hash_stability("sha256", "random", False).stable
    assert "PYTHONHASHSEED" in hash_stability("xxhash", None, True).reason


def test_block_hash_bytes() -> None:
    d = bytes(range(32))
    assert block_hash_bytes(d) == d
    assert block_hash_bytes(bytearray(d)) == d
    assert block_hash_bytes(255) == b"\x00\xff"
    assert block_hash_bytes(-1) == b"\xff"
    assert block_hash_bytes(0) == b"\x00"

    class Old:
        hash_value = 7

    assert block_hash_bytes(Old()) == b"\x07"
    long = block_hash_bytes(b"x" * 100)
    assert len(long) == 32 and long == block_hash_bytes(b"x" * 100)
    with pytest.raises(TypeError):
        block_hash_bytes(1.5)
