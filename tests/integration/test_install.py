"""Installation as an operator does it: the wheel that CI builds and ``pip install
<checkout>``, each into a fresh virtual environment, give working ``pegaflow*`` commands
and importable packages, run from outside the source tree (so the checkout cannot shadow
the install).

The wheel and the sdist are ``scripts/build.sh``'s: ``scripts/test.sh`` builds them
into ``dist/`` and names that folder in ``PEGAFLOW_DIST``; without it (pytest run alone)
they are built here from a copy of the checkout.  The wheel is built from the sdist, so
a package the sdist lacks is missing from the wheel too.

Offline: no build isolation (the setuptools of this environment), and the fresh
environments take their dependencies from this one's site-packages (a ``.pth`` line)
instead of an index.  The docs and configs name only what really installs.
"""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.support.install import REPO, check_installed, fresh_venv, pip, sh

SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


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


@pytest.fixture(scope="module")
def dist(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the sdist and the wheel: CI's build, else one of ``source``."""
    if os.environ.get("PEGAFLOW_DIST"):
        return Path(os.environ["PEGAFLOW_DIST"])
    out = tmp_path_factory.mktemp("dist")
    sh(source / "scripts" / "build.sh", out, cwd=source, env={"PYTHON": sys.executable})
    return out


def test_the_sdist_holds_every_package_and_the_license(dist: Path) -> None:
    (sdist,) = dist.glob("pegaflow_cluster-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    dirs = SETUPTOOLS["package-dir"]
    for package in SETUPTOOLS["packages"]:
        top = max((p for p in dirs if f"{package}.".startswith(f"{p}.")), key=len)
        folder = dirs[top] + package[len(top) :].replace(".", "/")
        assert f"{folder}/__init__.py" in names, package
    assert {"LICENSE", "pyproject.toml", "README.md"} <= names


def test_the_wheel_installs_into_a_fresh_venv_with_its_extras(dist: Path, tmp_path: Path) -> None:
    """UCX comes only with an extra: a coordinator or router host installs none."""
    (wheel,) = dist.glob("pegaflow_cluster-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(whl.read(meta))
    for package in SETUPTOOLS["packages"]:
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    for module in ("pegaflow/tools/cli.py", "pegaflow/connector/connector.py",
                   "pegaflow/coordinator/main.py", "pegaflow/storage_node/main.py"):  # fmt: skip
        assert module in names, module
    assert not [n for n in names if n.startswith(("tests/", "scripts/"))]
    assert metadata["License-Expression"] == "Apache-2.0"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    ucx = [r for r in metadata.get_all("Requires-Dist") if r.startswith("ucxx")]
    assert sorted(ucx) == ['ucxx-cu12>=0.45; extra == "cu12"', 'ucxx-cu13>=0.46; extra == "cu13"']
    assert {"cu12", "cu13", "vllm", "router"} <= set(metadata.get_all("Provides-Extra"))
    bindir = fresh_venv(tmp_path / "venv")
    pip(bindir, "install", f"{wheel}[cu12,router]", cwd=tmp_path)
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
