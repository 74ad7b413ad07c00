"""The command lines as an operator meets them: the real entry points run as processes.

Every bad invocation (a bad address, a missing or malformed config file, an unknown
option, a bad value) is one line on stderr and exit status 2, never a traceback;
``--config`` goes anywhere; the help names values by what they are and shows defaults.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
# a start that got past its configuration would serve: keep it small and local
SAFE = ["--node-http-port", "-1", "--node-ucx-port", "0", "--node-pool-bytes", "64MiB"]


def run(prog: str, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PEGAFLOW_")}
    full_env.update(env or {})
    return subprocess.run(
        [str(BIN / prog), *argv],
        capture_output=True,
        text=True,
        timeout=20,
        env=full_env,
        cwd="/",
    )


def assert_one_line_error(p: subprocess.CompletedProcess, prog: str, *words: str) -> str:
    err = p.stderr.strip()
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    assert len(err.splitlines()) == 1, p.stderr
    assert err.startswith((f"{prog}:", f"{prog} status:")), err
    for w in words:
        assert w in err, (w, err)
    return err


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("cli")
    paths = {
        "malformed": "[node\npool_bytes = 1\n",
        "unknown": "[node]\npool_byte = 1\n",
        "badbool": '[node]\nkeep_pool = "maybe"\n',
        "refused": '[client]\ncoordinators = ["127.0.0.1:1"]\n',
    }
    out = {}
    for name, text in paths.items():
        (d / f"{name}.toml").write_text(text)
        out[name] = str(d / f"{name}.toml")
    out["shm"] = str(d)
    return out


@pytest.mark.parametrize(
    "prog,argv,words",
    [
        ("pegaflow", ["status", "--coordinators", "nonsense"], ["nonsense"]),
        ("pegaflow", ["status", "--coordinators", "127.0.0.1:http"], ["127.0.0.1:http"]),
        ("pegaflow", ["--config", "/nonexistent.toml", "status"], ["/nonexistent.toml"]),
        ("pegaflow", ["status", "--config", "/nonexistent.toml"], ["/nonexistent.toml"]),
        ("pegaflow", ["status", "--config", "{malformed}"], ["malformed.toml"]),
        ("pegaflow", ["status", "--bogus"], ["--bogus"]),
        ("pegaflow", ["status", "--timeout", "soon"], ["--timeout", "soon"]),
        ("pegaflow", [], ["status"]),
        ("pegaflow", ["stats"], ["stats"]),
        ("pegaflow-node", ["--node-keep-pool", "maybe", *SAFE], ["--node-keep-pool", "maybe"]),
        ("pegaflow-node", ["--node-pool-bytes", "2XB"], ["--node-pool-bytes", "2XB"]),
        ("pegaflow-node", ["--node-pool-bytes", "1.5.2"], ["1.5.2"]),
        ("pegaflow-node", ["--config", "{malformed}"], ["malformed.toml"]),
        ("pegaflow-node", ["--config", "{unknown}"], ["pool_byte"]),
        ("pegaflow-node", ["--config", "{badbool}", *SAFE], ["keep_pool", "maybe"]),
        ("pegaflow-node", ["--etcd-endpoints", "etcd-without-port", *SAFE], ["etcd-without"]),
        ("pegaflow-node", ["--node-ucx-port", "70000"], ["70000"]),
        ("pegaflow-coordinator", ["--bogus"], ["--bogus"]),
        ("pegaflow-coordinator", ["--coordinator-port", "abc"], ["--coordinator-port", "abc"]),
        ("pegaflow-coordinator", ["--log-level", "chatty"], ["chatty"]),
        ("pegaflow-server", ["--pool-size", "lots"], ["lots"]),
        ("pegaflow-server", ["--config", "/nonexistent.toml"], ["/nonexistent.toml"]),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else str(v),
)
def test_bad_invocations_are_one_line_and_exit_2(
    prog: str, argv: list[str], words: list[str], files: dict[str, str]
) -> None:
    argv = [a.format(**files) for a in argv]
    if prog == "pegaflow-node":
        argv += ["--node-shm-dir", files["shm"]]
    assert_one_line_error(run(prog, *argv), prog, *words)


def test_bad_environment_value_is_one_line(files: dict[str, str]) -> None:
    p = run(
        "pegaflow-node", *SAFE, "--node-shm-dir", files["shm"],
        env={"PEGAFLOW_NODE_LOCAL_ACCESS": "maybe"},
    )  # fmt: skip
    assert_one_line_error(p, "pegaflow-node", "PEGAFLOW_NODE_", "local_access", "maybe")


def test_config_goes_before_or_after_the_subcommand(files: dict[str, str]) -> None:
    """Both spellings read the file: its coordinator (a refused port) is the one asked."""
    for argv in (
        ["--config", files["refused"], "status", "--timeout", "2"],
        ["status", "--timeout", "2", "--config", files["refused"]],
    ):
        err = assert_one_line_error(run("pegaflow", *argv), "pegaflow", "127.0.0.1:1")
        assert "cannot get status" in err


def entry(help_text: str, flag: str) -> str:
    """The help of one flag, its lines joined: ``"--timeout SECONDS deadline ..."``."""
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(flag + " "))
    end = next(
        (i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * 8)), len(lines)
    )
    return " ".join(" ".join(lines[start:end]).split())


@pytest.mark.parametrize(
    "argv", [["pegaflow", "--help"], ["pegaflow", "status", "--help"]], ids=" ".join
)
def test_status_help(argv: list[str]) -> None:
    p = run(*argv)
    assert p.returncode == 0, p.stderr
    assert entry(p.stdout, "--config").startswith("--config FILE")
    if argv[-2] == "status":
        assert entry(p.stdout, "--coordinators").startswith("--coordinators HOST:PORT")
        timeout = entry(p.stdout, "--timeout")
        assert timeout.startswith("--timeout SECONDS") and "(default: 5.0)" in timeout


@pytest.mark.parametrize("prog", ["pegaflow-node", "pegaflow-coordinator", "pegaflow-server"])
def test_service_help_is_readable(prog: str) -> None:
    p = run(prog, "--help")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert not re.search(r"[A-Z]+__[A-Z_]+", out), "metavars must not be argparse dests"
    assert "--node-node-id" not in out, "no stuttering flag names"
    assert entry(out, "--config").startswith("--config FILE")
    assert entry(out, "--etcd-endpoints").startswith("--etcd-endpoints HOST:PORT")
    assert entry(out, "--etcd-timeout-s") == (
        "--etcd-timeout-s SECONDS deadline of one etcd call (default: 5.0)"
    )
    if prog == "pegaflow-coordinator":
        assert entry(out, "--coordinator-port").startswith("--coordinator-port PORT")
        assert entry(out, "--coordinator-port").endswith("(default: 7700)")
        return
    assert entry(out, "--node-id").startswith("--node-id NAME")
    assert entry(out, "--node-slab-bytes").startswith("--node-slab-bytes SIZE")
    assert entry(out, "--node-slab-bytes").endswith("(default: 64MiB)")
    keep = entry(out, "--node-keep-pool")
    assert keep.startswith("--node-keep-pool [BOOL]") and keep.endswith("(default: true)")
    pool = entry(out, "--node-pool-bytes")
    assert pool.endswith("(default: 0)" if prog == "pegaflow-server" else "(default: 1GiB)")


@pytest.mark.parametrize(
    ("prog", "flag", "argv"),
    [
        ("pegaflow-server", "--coordinator-http-port",
         ["--coordinator-port", "0", "--node-shm-dir", "/dev/shm", *SAFE]),
        ("pegaflow-server", "--coordinator-port",
         ["--coordinator-http-port", "0", "--node-shm-dir", "/dev/shm", *SAFE]),
        ("pegaflow-coordinator", "--coordinator-http-port", ["--coordinator-port", "0"]),
    ],
)  # fmt: skip
def test_a_port_in_use_is_named_by_its_flag(prog: str, flag: str, argv: list[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        p = run(prog, *argv, flag, port)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr
    assert f"127.0.0.1:{port} is in use ({flag} picks another)" in p.stderr, p.stderr[-2000:]
