"""Installing the package into a fresh virtual environment and checking what it installed."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMANDS = (
    "pegaflow",
    "pegaflow-node",
    "pegaflow-coordinator",
    "pegaflow-server",
    "pegaflow-router",
)
IMPORTS = (
    "import pegaflow.connector, pegaflow.coordinator, pegaflow.storage_node, pegaflow.client, "
    "pegaflow.router"
)


def sh(
    *argv: str | Path, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``argv`` offline (no index), with ``env`` added to the environment; it must
    succeed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PEGAFLOW_CONFIG")} | (
        env or {}
    )
    env["PIP_NO_INDEX"] = "1"  # nothing from an index: all of it is here
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    p = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, f"{argv}: rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def fresh_venv(where: Path) -> Path:
    """A new venv (no pip of its own) whose dependencies come from this environment."""
    sh(sys.executable, "-m", "venv", "--without-pip", where, cwd=where.parent)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(where), "platbase": str(where)}))
    (purelib / "deps-from-the-test-environment.pth").write_text(
        sysconfig.get_path("purelib") + "\n"
    )
    return where / "bin"


def check_installed(bindir: Path, outside: Path) -> None:
    for cmd in COMMANDS:
        p = sh(bindir / cmd, "--help", cwd=outside)
        assert "usage:" in p.stdout, p.stdout
    p = sh(bindir / "python", "-c", f"{IMPORTS}; print(pegaflow.connector.__file__)", cwd=outside)
    installed = Path(p.stdout.strip())
    assert installed.is_relative_to(bindir.parent), f"imported {installed}, not the install"
    p = sh(
        bindir / "python",
        "-c",
        "import importlib.resources as r; print(r.files('pegaflow.tools.dashboard')"
        ".joinpath('index.html').is_file())",
        cwd=outside,
    )
    assert p.stdout.strip() == "True", "the dashboard page ships with the package"


def pip(bindir: Path, *args: str | Path, cwd: Path) -> None:
    sh(sys.executable, "-m", "pip", "--python", bindir / "python", *args, cwd=cwd)
