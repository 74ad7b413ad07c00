"""Installation as an operator does it: a built wheel and ``pip install <checkout>``, each
into a fresh virtual environment, give working ``pegaflow*`` commands and importable
packages, run from outside the source tree (so the checkout cannot shadow the install).

Offline: the wheel is built without build isolation (the setuptools of this
environment), and the fresh environments take their dependencies from this one's
site-packages (a ``.pth`` line) instead of an index.  The docs and configs name only
what really installs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

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


def sh(*argv: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PEGAFLOW_CONFIG")}
    env["PIP_NO_INDEX"] = "1"  # nothing from an index: all of it is here
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    p = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, f"{argv}: rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout (its tracked and new files): a build writes build/ and
    *.egg-info next to the sources, which must not land in the shared tree."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    dst = tmp_path_factory.mktemp("src") / "pegaflow-cluster"
    for name in filter(None, (f.decode() for f in files)):
        src = REPO / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    return dst


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


def test_wheel_installs_into_a_fresh_venv(source: Path, tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
       "-w", dist, source, cwd=tmp_path)  # fmt: skip
    (wheel,) = dist.glob("pegaflow_cluster-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("pegaflow/tools/cli.py", "pegaflow/connector/connector.py",
                   "pegaflow/coordinator/main.py", "pegaflow/storage_node/main.py"):  # fmt: skip
        assert module in names, module
    assert not [n for n in names if n.startswith(("tests/", "scripts/"))]
    bindir = fresh_venv(tmp_path / "venv")
    pip(bindir, "install", "--no-deps", wheel, cwd=tmp_path)
    check_installed(bindir, tmp_path)


def test_pip_install_of_the_checkout_into_a_fresh_venv(source: Path, tmp_path: Path) -> None:
    bindir = fresh_venv(tmp_path / "venv")
    pip(bindir, "install", "--no-deps", "--no-build-isolation", source, cwd=tmp_path)
    check_installed(bindir, tmp_path)


def test_docs_and_configs_name_what_installs() -> None:
    """No ``pip install pegaflow-cluster`` from an index: no index serves it."""
    bad = re.compile(r"pip3? install (-\S+ )*['\"]?pegaflow-cluster\b")
    paths = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "configs").rglob("*")]
    offenders = [
        f"{p.relative_to(REPO)}: {m.group(0)}"
        for p in paths
        if p.is_file()
        for m in bad.finditer(p.read_text(errors="replace"))
    ]
    assert not offenders, offenders
