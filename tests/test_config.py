"""Config loading precedence and the generated reference (pure logic)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pegaflow.config import load_config, parse_size, reference_markdown

REPO = Path(__file__).resolve().parent.parent


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
    "text,value", [("512MiB", 512 << 20), ("8G", 8 << 30), ("4096", 4096), (7, 7)]
)
def test_sizes(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_example_configs_load(path: Path) -> None:
    cfg = load_config(path, env={})
    assert cfg.node.pool_bytes > 0 and cfg.etcd.prefix.startswith("/")


def test_reference_doc_is_current() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert doc == reference_markdown(), (
        "regenerate: python -m pegaflow.config > docs/configuration.md"
    )
