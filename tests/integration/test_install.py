"""Installation as an operator does it: a built wheel and ``pip install <checkout>``, each
into a fresh virtual environment, give working ``pegaflow*`` commands and importable
packages, run from outside the source tree (so the checkout cannot shadow the install).

Offline: the wheel is built without build isolation (the setuptools of this
environment), and the fresh environments take their dependencies from this one's
site-packages (a ``.pth`` line) instead of an index.  The docs and configs name only
what really installs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.install import REPO, check_installed, fresh_venv, pip, sh


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
