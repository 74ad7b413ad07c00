"""Rough edges of the command lines (issue 40), met as an operator meets them: the real
entry points run as processes.

``--version`` on every program, from the one version of the distribution; PegaFlow's
``--pool-size`` / ``--fresh-pool`` spellings named as given in errors and taking
``=VALUE``; the help's metavars say what a value is; a reader that goes away
(``pegaflow status | head -3``) ends the output without a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import distribution, version
from pathlib import Path

import pytest

from pegaflow.server import _aliases
from pegaflow.tools.devcluster import Proc, start_coordinator

BIN = Path(sys.executable).parent
PROGRAMS = sorted(
    ep.name for ep in distribution("pegaflow-cluster").entry_points if ep.group == "console_scripts"
)


def run(prog: str, *argv: str, **kw: object) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEGAFLOW_")}
    return subprocess.run(
        [str(BIN / prog), *argv], text=True, timeout=30, env=env, cwd="/", **kw
    )  # type: ignore[call-overload]


def test_every_program_is_listed() -> None:
    assert set(PROGRAMS) >= {
        "pegaflow", "pegaflow-coordinator", "pegaflow-node", "pegaflow-server", "pegaflow-router",
    }  # fmt: skip


@pytest.mark.parametrize("prog", PROGRAMS)
def test_version_prints_the_program_and_the_distributions_version(prog: str) -> None:
    p = run(prog, "--version", capture_output=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"{prog} {version('pegaflow-cluster')}\n"
    assert "--version" in run(prog, "--help", capture_output=True).stdout


@pytest.mark.parametrize(
    "argv,flag,words",
    [
        (["--pool-size", "abc"], "--pool-size", "not a size: 'abc'"),
        (["--pool-size=abc"], "--pool-size", "not a size: 'abc'"),
        (["--pool-size"], "--pool-size", "expected one argument"),
        (["--fresh-pool=maybe"], "--fresh-pool", "not a boolean: 'maybe'"),
    ],
)
def test_server_aliases_are_named_as_given(argv: list[str], flag: str, words: str) -> None:
    p = run("pegaflow-server", *argv, capture_output=True)
    err = p.stderr.strip()
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert err.splitlines() == [err] and "Traceback" not in err
    assert f"argument {flag}: {words}" in err
    assert "--node-" not in err


def test_fresh_pool_takes_a_value() -> None:
    assert _aliases(["--fresh-pool=true", "--fresh-pool", "--fresh-pool=off"]) == [
        "--node-fresh-pool", "true", "--node-fresh-pool", "true", "--node-fresh-pool", "off",
    ]  # fmt: skip


@pytest.mark.parametrize("prog", PROGRAMS)
def test_help_has_no_rst_markup(prog: str) -> None:
    out = run(prog, "--help", capture_output=True).stdout
    assert "``" not in out


def test_help_metavars_say_what_a_value_is() -> None:
    out = " ".join(run("pegaflow-server", "--help", capture_output=True).stdout.split())
    assert "--node-disk-path DIR " in out  # a folder, not a FILE
    assert "--coordinator-gc-entries-per-s N " in out  # a rate, not SECONDS


@pytest.fixture(scope="module")
def coordinator() -> Iterator[Proc]:
    p = start_coordinator()
    try:
        yield p
    finally:
        p.terminate()


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_status_into_a_closed_pipe_ends_quietly(coordinator: Proc, json_flag: list[str]) -> None:
    """``pegaflow status | head -3``: the reader is gone before the table is written."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = run(
            "pegaflow", "status", "--coordinators", coordinator.ready["address"], *json_flag,
            stdout=w, stderr=subprocess.PIPE,
        )  # fmt: skip
    finally:
        os.close(w)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize(
    "where,words",
    [
        ("missing", "no such directory"),
        ("file", "not a directory"),
        ("empty", "holds no tokenizer: none of tokenizer.json"),
    ],
)
def test_a_tokenizer_path_that_is_none_is_said_so(tmp_path: Path, where: str, words: str) -> None:
    path = {"missing": tmp_path / "nonexistent", "file": tmp_path / "f", "empty": tmp_path}[where]
    if where == "file":
        path.write_text("x")
    p = run(
        "pegaflow-router", "--router-tokenizer", str(path), "--router-mode", "cache",
        "--router-port", "0", "--router-replicas", "http://127.0.0.1:1", capture_output=True,
    )  # fmt: skip
    err = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2, p.stderr
    assert f"--router-tokenizer {path}: {words}" in err
    assert "Repo id" not in p.stderr and "Traceback" not in p.stderr
