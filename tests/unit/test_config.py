"""Config loading precedence and the generated reference (pure logic)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pegaflow.config import (
    ArgParser,
    add_arguments,
    check_address,
    config_from_args,
    flag_name,
    load_config,
    parse_bool,
    parse_size,
    reference_markdown,
)

REPO = Path(__file__).resolve().parents[2]


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[node]\npool_bytes = "2GiB"\nucx_port = 9000\n[etcd]\nendpoints = ["a:1"]\n')
    cfg = load_config(
        f, env={"PEGAFLOW_NODE_UCX_PORT": "9100"}, overrides={"etcd": {"endpoints": "b:2,c:3"}}
    )
    assert cfg.node.pool_bytes == 2 << 30
    assert cfg.node.ucx_port == 9100
    assert cfg.etcd.endpoints == ["b:2", "c:3"]


def test_unknown_option_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[node]\npool_byte = 1\n")
    with pytest.raises(ValueError, match="unknown option 'pool_byte'"):
        load_config(f, env={})


@pytest.mark.parametrize(
    "text,value",
    [
        ("512MiB", 512 << 20),
        ("2GiB", 2**31),
        ("2GB", 2 * 10**9),
        ("2gb", 2 * 10**9),
        ("2G", 2**31),  # a bare letter is binary (documented in SIZE_RULE)
        ("8G", 8 << 30),
        ("1.5GiB", 3 << 29),
        ("64 MiB", 64 << 20),
        ("4096", 4096),
        ("4096B", 4096),
        ("0", 0),
        (7, 7),
        (1e9, 10**9),
    ],
)
def test_sizes(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize(
    "text", ["2XB", "1.5.2", "", "GiB", "-1", "0.1KiB", "1.5", "2 G B", "lots", -5, 1.5, True]
)
def test_sizes_refuse_garbage(text: object) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text,value",
    [("true", True), ("Yes", True), ("on", True), ("1", True), (1, True),
     ("false", False), ("NO", False), ("off", False), ("0", False), (False, False)],
)  # fmt: skip
def test_booleans(text: str | int, value: bool) -> None:
    assert parse_bool(text) is value


@pytest.mark.parametrize("text", ["maybe", "", "2", "y", 2, None])
def test_booleans_are_strict(text: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a boolean"):
        parse_bool(text)  # type: ignore[arg-type]
    if isinstance(text, str):
        with pytest.raises(ValueError, match="PEGAFLOW_NODE_KEEP_POOL"):
            load_config(env={"PEGAFLOW_NODE_KEEP_POOL": text})
    f = tmp_path / "c.toml"
    f.write_text('[node]\nkeep_pool = "maybe"\n')
    with pytest.raises(ValueError, match=r"\[node\]\.keep_pool: not a boolean: 'maybe'"):
        load_config(f, env={})


@pytest.mark.parametrize(
    "toml,match",
    [
        ("[node]\nucx_port = 1.5\n", "not an integer"),
        ("[node]\nucx_port = 70000\n", "not a port"),
        ("[node]\nmax_batch = true\n", "not an integer"),
        ('[client]\ncoordinators = ["no-port"]\n', "not an address: 'no-port'"),
        ('[etcd]\nendpoints = "a:1,b:x"\n', "not an address: 'b:x'"),
        ("[node\n", "not valid TOML"),
        ("[nodes]\n", "unknown table"),
    ],
)
def test_bad_values_in_a_file(tmp_path: Path, toml: str, match: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(toml)
    with pytest.raises(ValueError, match=match):
        load_config(f, env={})


def test_missing_file_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"/nonexistent\.toml"):
        load_config("/nonexistent.toml", env={})


@pytest.mark.parametrize(
    "addr", ["10.0.0.1:7700", "[::1]:7700", "http://etcd-0:2379", "https://e:2379", "unix:/x"]
)
def test_addresses(addr: str) -> None:
    assert check_address(addr) == addr


def test_flags_do_not_stutter_and_old_spellings_still_work() -> None:
    assert flag_name("node", "node_id") == "--node-id"
    assert flag_name("node", "pool_bytes") == "--node-pool-bytes"
    parser = ArgParser(prog="t")
    add_arguments(parser, ["node"])
    for argv in (["--node-id", "a"], ["--node-node-id", "a"]):
        assert config_from_args(parser.parse_args(argv)).node.node_id == "a"
    args = parser.parse_args(["--node-keep-pool", "--node-local-access", "off"])
    cfg = config_from_args(args)
    assert cfg.node.keep_pool is True and cfg.node.local_access is False
    assert config_from_args(parser.parse_args(["--node-pool-bytes", "2GB"])).node.pool_bytes == (
        2 * 10**9
    )


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_example_configs_load(path: Path) -> None:
    cfg = load_config(path, env={})
    assert cfg.node.pool_bytes > 0 and cfg.etcd.prefix.startswith("/")


def test_reference_doc_is_current() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert doc == reference_markdown(), (
        "regenerate: python -m pegaflow.config > docs/configuration.md"
    )
