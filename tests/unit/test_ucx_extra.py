"""UCX is an extra (``cu12`` / ``cu13``): a coordinator or router host runs without
``ucxx``, and the data plane started without it fails at once, naming the extra.

Each case runs in a fresh interpreter; "without ucxx" is an import hook that refuses it
as an uninstalled module would be refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

NO_UCXX = """
import importlib.abc, sys

class NoUcxx(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("ucxx", "libucxx", "libucx"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoUcxx())
"""


def python(code: str, *, without_ucxx: bool = False) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (with ucxx refused, if asked)."""
    env = {k: v for k, v in os.environ.items() if k != "PEGAFLOW_CONFIG"}
    src = (NO_UCXX if without_ucxx else "") + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", src], capture_output=True, text=True, timeout=120, env=env
    )


def test_the_control_plane_imports_no_ucxx() -> None:
    """``pegaflow-coordinator``, ``pegaflow-router`` and ``pegaflow --help`` load no UCX,
    and neither do the node's and the server's ``--help``."""
    p = python("""
        import contextlib, io, sys
        import pegaflow.coordinator.main, pegaflow.router.main
        from pegaflow import server
        from pegaflow.storage_node import main as node
        from pegaflow.tools import cli
        for run in (cli.main, node.main, server.main):
            with contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    run(["--help"])
                except SystemExit as e:
                    assert e.code == 0, e.code
            assert "usage:" in out.getvalue(), out.getvalue()
        print(sorted(m for m in sys.modules if m.partition(".")[0] in ("ucxx", "libucxx")))
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout


def test_the_connector_without_ucxx_names_the_extra() -> None:
    p = python(
        """
        from pegaflow.errors import UcxNotInstalled
        try:
            import pegaflow.connector.connector
        except UcxNotInstalled as e:
            assert isinstance(e, ImportError) and e.name == "ucxx"
            print(e)
        """,
        without_ucxx=True,
    )
    assert p.returncode == 0, p.stderr
    for named in ("No module named 'ucxx", "pegaflow-cluster[cu12]", "pegaflow-cluster[cu13]"):
        assert named in p.stdout, p.stdout


@pytest.mark.parametrize("module", ["pegaflow.storage_node.main", "pegaflow.server"])
def test_a_node_or_server_started_without_ucxx_fails_at_once_naming_the_extra(
    module: str,
) -> None:
    """One line on stderr and exit status 2, before anything is created."""
    p = python(
        f"""
        import {module} as m
        m.main(["--node-ucx-port", "0", "--node-http-port", "-1", "--node-pool-bytes", "1MiB"])
        """,
        without_ucxx=True,
    )
    assert p.returncode == 2, (p.returncode, p.stderr)
    last = p.stderr.strip().splitlines()[-1]
    assert "cannot import ucxx" in last and "[cu12]" in last and "[cu13]" in last, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
