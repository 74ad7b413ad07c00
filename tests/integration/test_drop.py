"""``pegaflow drop``: an operator drops one namespace's blocks from a real node."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from pegaflow.client import SyncPegaClient

from pegaflow.errors import BadRequest, Unauthorized
from pegaflow.tools.devcluster import REPO, Proc, token_env
from tests.support.tenant_server import client_of, tenant_server
from tests.support.waiting import wait_for

pytestmark = pytest.mark.ucx

SIZE = 4096


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    p = tenant_server("32MiB")
    try:
        yield p
    finally:
        p.terminate()


def _put(c: SyncPegaClient, node: str, ns: str, n: int) -> tuple[list[bytes], np.ndarray]:
    hashes = [os.urandom(16) for _ in range(n)]
    data = np.random.default_rng(n).integers(0, 255, (n, SIZE), dtype=np.uint8)
    out = c.put_blocks(ns, [(h, 0, data[i]) for i, h in enumerate(hashes)], node_id=node)
    assert out.stored == n
    return hashes, data


def _drop_cli(
    server: Proc, node: str, ns: str, token: str = "admin"
) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pegaflow.tools.cli", "drop", "--node", node, "--namespace", ns,
            "--coordinators", server.ready["coordinator"]]  # fmt: skip
    env = {**os.environ, **token_env(token)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)


def test_drop_removes_one_namespace_and_waits_for_its_pins(server: Proc) -> None:
    node = server.ready["node"]
    c = client_of(server)
    try:
        gone, _ = _put(c, node, "drop-a", 4)
        kept, kept_data = _put(c, node, "drop-b", 2)
        wait_for(lambda: c.lookup("drop-a", gone).hits == 4, "the blocks to be published")
        pin, where = c.locate("drop-a", node, gone[:1], 0, 30.0)  # one block being read
        assert where.found.all()

        done = _drop_cli(server, node, "drop-a")
        assert done.returncode == 0, done.stderr
        assert "dropped 3 blocks of 'drop-a'; 1 being read" in done.stdout

        session = c.node_session(node)
        assert session.check("drop-a", [(h, 0, None) for h in gone]) == [True] + [False] * 3
        wait_for(
            lambda: c.lookup("drop-a", gone[1:]).hits == 0, "the dropped blocks to leave the index"
        )
        # the other namespace is untouched, byte for byte
        assert session.check("drop-b", [(h, 0, None) for h in kept]) == [True, True]
        out = np.zeros_like(kept_data)
        assert all(c.get_blocks("drop-b", [(node, h, 0, out[i]) for i, h in enumerate(kept)]))
        assert (out == kept_data).all()
        # the pinned block goes once its pin does
        c.unpin(node, pin)
        wait_for(
            lambda: not session.check("drop-a", [(gone[0], 0, None)])[0], "the pinned block to go"
        )
        wait_for(lambda: c.lookup("drop-a", gone[:1]).hits == 0, "it to leave the index")
        assert c.lookup("drop-b", kept).hits == 2
        # the namespace can be written again
        again, _ = _put(c, node, "drop-a", 1)
        assert session.check("drop-a", [(again[0], 0, None)]) == [True]
    finally:
        c.close()


def test_only_the_cluster_token_drops_and_bad_requests_are_typed(server: Proc) -> None:
    node = server.ready["node"]
    acme = client_of(server, "a-secret")
    c = client_of(server)
    try:
        mine, _ = _put(acme, node, "acme@m", 1)
        with pytest.raises(Unauthorized):
            acme.drop(node, "acme@m")
        refused = _drop_cli(server, node, "acme@m", token="a-secret")
        assert refused.returncode == 2 and "unauthorized" in refused.stderr
        with pytest.raises(BadRequest):
            c.drop(node, "")
        assert acme.node_session(node).check("acme@m", [(mine[0], 0, None)]) == [True]
        assert c.drop(node, "nothing-here").dropped == 0  # the node keeps serving
    finally:
        acme.close()
        c.close()
