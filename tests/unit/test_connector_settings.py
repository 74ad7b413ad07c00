"""Connector settings (extra config + PEGAFLOW_* env), namespaces, hash stability."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from pegaflow.connector import settings as settings_mod
from pegaflow.connector.namespace import (
    NamespaceFactors,
    ShardLayout,
    block_hash_bytes,
    hash_stability,
    make_namespace,
)
from pegaflow.connector.settings import ConnectorSettings

from pegaflow.protocol.codec import check_namespace


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
        {"save_decode_blocks": ""},
        {"coordinators": "no-port"},
        {"pegaflow.port": "grpc"},
        {"pegaflow.host": "10.0.0.1", "coordinators": "10.0.0.2:7700"},
        {"pegaflow.mode": "read_write", "mode": "off"},
        {"pegaflow.mode": "sometimes"},
        {"pegaflow.hots": "10.0.0.1"},
    ],
)
def test_bad_settings_are_rejected(extra: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ConnectorSettings.load(extra, env={})


@pytest.fixture
def fresh_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings_mod, "_noticed", set())


@pytest.mark.parametrize(
    "extra,coordinators",
    [
        ({"pegaflow.host": "http://10.0.0.1", "pegaflow.port": 50055}, ["10.0.0.1:50055"]),
        ({"pegaflow.host": "10.0.0.1", "pegaflow.port": "7701"}, ["10.0.0.1:7701"]),
        ({"pegaflow.host": "http://10.0.0.1:7702/"}, ["10.0.0.1:7702"]),
        ({"pegaflow.host": "10.0.0.1"}, ["10.0.0.1:7700"]),  # our default port, not 50055
        ({"pegaflow.port": 7703}, ["127.0.0.1:7703"]),
        ({"pegaflow.host": "::1", "pegaflow.port": 7704}, ["[::1]:7704"]),
    ],
)
def test_pegaflow_host_and_port_become_coordinators(
    extra: dict[str, object], coordinators: list[str], fresh_notices: None
) -> None:
    assert ConnectorSettings.load(extra, env={}).coordinators == coordinators


def test_pegaflow_keys_are_noticed_once_naming_ours(
    caplog: pytest.LogCaptureFixture, fresh_notices: None
) -> None:
    """A PegaFlow config works as written; the log says once which key to write instead."""
    extra = {
        "pegaflow.host": "http://10.0.0.1",
        "pegaflow.port": 7700,
        "pegaflow.mode": "save_only",
        "pegaflow.wait_for_full_prefix": True,
        "local_node": "host-a",
    }
    with caplog.at_level(logging.INFO, logger="pegaflow.connector"):
        s = ConnectorSettings.load(extra, env={})
        s2 = ConnectorSettings.load(extra, env={})
    assert s == s2
    assert s.coordinators == ["10.0.0.1:7700"] and s.mode == "save_only" and not s.can_load
    assert s.local_node == "host-a"
    msgs = [r.getMessage() for r in caplog.records]
    host = [m for m in msgs if "'pegaflow.host'" in m]
    assert len(host) == 1 and '"coordinators": "10.0.0.1:7700"' in host[0], msgs
    mode = [m for m in msgs if "'pegaflow.mode'" in m]
    assert len(mode) == 1 and '"mode"' in mode[0], msgs
    ignored = [r for r in caplog.records if "pegaflow.wait_for_full_prefix" in r.getMessage()]
    assert len(ignored) == 1 and ignored[0].levelno == logging.WARNING
    assert "ignored" in ignored[0].getMessage()


def test_pegaflow_environment_is_the_lowest_layer(fresh_notices: None) -> None:
    env = {"PEGAFLOW_HOST": "http://10.0.0.9", "PEGAFLOW_PORT": "7710"}
    assert ConnectorSettings.load({}, env=env).coordinators == ["10.0.0.9:7710"]
    env["PEGAFLOW_CLIENT_COORDINATORS"] = "10.0.0.8:7700"
    assert ConnectorSettings.load({}, env=env).coordinators == ["10.0.0.8:7700"]
    extra = {"pegaflow.host": "10.0.0.7"}
    assert ConnectorSettings.load(extra, env=env).coordinators == ["10.0.0.7:7700"]
    with pytest.raises(ValueError, match="PEGAFLOW_HOST"):
        ConnectorSettings.load({}, env={"PEGAFLOW_PORT": "http"})


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
    dense = ShardLayout(tp_size=2, pp_size=2)
    assert dense.shards == 4 and dense.tp_factor() == 2
    assert [dense.shard(t, p) for p in range(2) for t in range(2)] == [0, 1, 2, 3]
    assert all(dense.saves(t) for t in range(2))


def test_mla_has_one_shard_per_stage_saved_by_tp_rank_0() -> None:
    """Every TP rank holds the same latent KV: one shard per PP stage, stored by its TP
    rank 0 and loaded by every rank, under a namespace without the TP size."""
    mla = ShardLayout(tp_size=2, pp_size=2, replicated=True)
    assert mla.shards == 2 and mla.tp_factor() == 0
    assert [mla.shard(t, p) for p in range(2) for t in range(2)] == [0, 0, 1, 1]
    assert [mla.rank(t, p) for p in range(2) for t in range(2)] == [0, 1, 2, 3]
    assert [mla.saves(t) for t in range(2)] == [True, False]
    assert ShardLayout(1, 2, replicated=True).tp_factor() == mla.tp_factor()
    # dummy weights are drawn per rank's slice: another TP size is another model
    assert mla.tp_factor(dummy_weights=True) == 2


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


def test_a_connector_log_level_prints_each_line_once(capsys: pytest.CaptureFixture[str]) -> None:
    """With ``log_level`` the connector's loggers get a handler of their own; a root
    handler (vLLM 0.26 has one on the H200) must not print every line a second time."""
    from pegaflow.connector.logsetup import setup_logging as _setup_logging

    log = logging.getLogger("pegaflow")
    root = logging.getLogger()
    saved = (log.handlers[:], log.level, log.propagate, root.handlers[:])
    log.handlers.clear()
    root_handler = logging.StreamHandler()
    root.addHandler(root_handler)
    try:
        _setup_logging("debug")
        logging.getLogger("pegaflow.connector").debug("PegaFlow: once")
        assert capsys.readouterr().err.count("PegaFlow: once") == 1
    finally:
        root.removeHandler(root_handler)
        log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]


@pytest.mark.parametrize(
    "extra,env",
    [
        ({"pegaflow.host": "http://10.0.0.1", "pegaflow.port": 50055}, {}),
        ({"pegaflow.host": "http://10.0.0.1:50055"}, {}),
        ({}, {"PEGAFLOW_HOST": "10.0.0.1", "PEGAFLOW_PORT": "50055"}),
    ],
)
def test_pegaflows_server_port_is_said_to_have_no_listener(
    extra: dict[str, object],
    env: dict[str, str],
    caplog: pytest.LogCaptureFixture,
    fresh_notices: None,
) -> None:
    """PegaFlow's 50055 is kept as given, and a warning says nothing listens there and
    what to write instead."""
    with caplog.at_level(logging.WARNING, logger="pegaflow.connector"):
        s = ConnectorSettings.load(extra, env=env)
    assert s.coordinators == ["10.0.0.1:50055"]
    warned = [r.getMessage() for r in caplog.records if "50055" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "no PegaFlow cluster service listens on 50055" in warned[0]
    assert '"coordinators": "10.0.0.1:7700"' in warned[0]


def test_a_coordinator_port_is_not_warned_about(
    caplog: pytest.LogCaptureFixture, fresh_notices: None
) -> None:
    with caplog.at_level(logging.WARNING, logger="pegaflow.connector"):
        ConnectorSettings.load({"pegaflow.host": "10.0.0.1", "pegaflow.port": 7700}, env={})
    assert not caplog.records
