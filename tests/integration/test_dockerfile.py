"""The container images (``Dockerfile``, ``configs/k8s/Dockerfile.vllm``), checked
without Docker (no registry is reachable here to pull a base image): their build stage
is replayed on the files it copies, the context's ``.dockerignore`` keeps none of them
out, the wheel built from that context alone installs and runs, and the commands the
image, its header and the Kubernetes manifests name are real commands with real flags.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import re
import shlex
import shutil
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from pegaflow.runner import build_parser
from tests.support.install import check_installed, fresh_venv, pip, sh

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = [REPO / "Dockerfile", REPO / "configs" / "k8s" / "Dockerfile.vllm"]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile, continuation lines joined."""
    out: list[tuple[str, str]] = []
    text = re.sub(r"\\\n", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copied(path: Path) -> list[str]:
    """The context paths the ``COPY`` instructions (not ``--from``) take."""
    paths = []
    for word, rest in instructions(path):
        if word == "COPY" and "--from" not in rest:
            *srcs, _dst = shlex.split(rest)
            paths += [s.rstrip("/") for s in srcs if not s.startswith("--")]
    return paths


def ignored(name: str) -> bool:
    """Whether ``.dockerignore`` keeps the context path ``name`` out (its patterns, with
    ``!`` exceptions, last match wins)."""
    out = False
    for pat in (REPO / ".dockerignore").read_text().splitlines():
        pat = pat.strip()
        if not pat or pat.startswith("#"):
            continue
        neg = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if fnmatch.fnmatch(name, pat) or fnmatch.fnmatch(name, pat.removeprefix("**/")):
            out = not neg
    return out


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_build_stage_copies_the_sources_and_nothing_it_ignores(path: Path) -> None:
    srcs = copied(path)
    assert "pyproject.toml" in srcs
    packages = {p.split(".", 1)[0] for p in ("pegaflow", "coordinator", "storage_node",
                                             "client", "connector", "router")}  # fmt: skip
    assert packages <= set(srcs), f"{path.name} misses {packages - set(srcs)}"
    for src in srcs:
        assert (REPO / src).exists(), f"{path.name} copies {src}, which is not in the checkout"
        assert not ignored(src), f".dockerignore keeps {src} out of {path.name}'s context"
    for kept_out in ("tests", ".venv", ".git", "docs"):
        assert ignored(kept_out), f".dockerignore should keep {kept_out} out of the context"
    froms = [rest.split()[0] for word, rest in instructions(path) if word == "FROM"]
    assert len(froms) == 2, "a build stage and the image"


def test_the_wheel_built_from_the_copied_context_alone_installs_and_runs(
    tmp_path: Path,
) -> None:
    """The build stage's ``pip wheel`` on exactly what it copies (the license file
    among them), then the image's install into a fresh environment: every command runs
    from outside the sources."""
    ctx = tmp_path / "src"
    for src in copied(REPO / "Dockerfile"):
        if (REPO / src).is_dir():
            shutil.copytree(REPO / src, ctx / src, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (ctx / src).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / src, ctx / src)
    dist = tmp_path / "dist"
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
       "-w", dist, ctx, cwd=tmp_path)  # fmt: skip
    (wheel,) = dist.glob("pegaflow_cluster-*.whl")  # the name the install step globs
    names = zipfile.ZipFile(wheel).namelist()
    assert "pegaflow/tools/dashboard/index.html" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    bindir = fresh_venv(tmp_path / "venv")
    pip(bindir, "install", f"{wheel}[cu12]", cwd=tmp_path)  # the image's default EXTRAS
    check_installed(bindir, tmp_path)


def _commands(text: str) -> list[list[str]]:
    """Every command line of a console script in ``text`` (comment markers and ``\\``
    continuations removed), as its argv up to the first word that is no flag or value."""
    text = re.sub(r"\\\n#?", " ", text)
    names = "|".join(sorted(map(re.escape, SCRIPTS), key=len, reverse=True))
    flag = r"(?: +--?[\w-]+(?:[ =](?!-)[^\s\\#]+)?)"
    pattern = rf"(?:^|(?<=[\s\"\[]))({names})(?=[\s\"]|$)({flag}*)"
    return [[m.group(1), *shlex.split(m.group(2))] for m in re.finditer(pattern, text, re.M)]


def _parser(prog: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser ``prog``'s ``main()`` builds (its ``run_service`` call, caught)."""
    module = {
        "pegaflow-coordinator": "pegaflow.coordinator.main",
        "pegaflow-node": "pegaflow.storage_node.main",
        "pegaflow-server": "pegaflow.server",
        "pegaflow-router": "pegaflow.router.main",
    }[prog]
    mod = importlib.import_module(module)
    seen: dict[str, Any] = {}

    def catch(prog: str, description: str | None, sections: list[str], run: Any,
              argv: Any = None, defaults: Any = None, prepare: Any = None) -> None:  # fmt: skip
        seen.update(prog=prog, description=description, sections=sections, defaults=defaults)

    monkeypatch.setattr(mod, "run_service", catch)
    mod.main([])
    return build_parser(seen["prog"], seen["description"], seen["sections"], seen["defaults"])


def test_every_command_the_images_and_manifests_name_parses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The header's ``docker run`` lines and the manifests' commands: real console
    scripts, with flags their own parsers take."""
    argvs = [a for p in DOCKERFILES for a in _commands(p.read_text())]
    for manifest in (REPO / "configs" / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(manifest.read_text()):
            pod = ((doc or {}).get("spec", {}).get("template", {}) or {}).get("spec", {})
            for c in pod.get("containers", []):
                cmd = [*c.get("command", []), *c.get("args", [])]
                if cmd and cmd[0].startswith("pegaflow"):
                    argvs.append(cmd)
    progs = {a[0] for a in argvs}
    assert {"pegaflow-coordinator", "pegaflow-node", "pegaflow-server"} <= progs, progs
    for argv in argvs:
        assert argv[0] in SCRIPTS, f"{argv[0]} is no console script of pyproject.toml"
        if argv[0] == "pegaflow":
            assert len(argv) == 1 or argv[1] in ("status", "drop", "--help"), argv
            continue
        _known, unknown = _parser(argv[0], monkeypatch).parse_known_args(argv[1:])
        assert not unknown, f"{' '.join(argv)}: unknown {unknown}"
