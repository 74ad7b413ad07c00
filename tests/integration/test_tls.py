"""TLS and token files on a real ``pegaflow-server``: a client without the CA or the
token is refused, one with both saves, looks up and reads the HTTP endpoints.

One server for the module, started with ``[security] tls_cert``/``tls_key``/``tls_ca``
and ``token_file`` (certificates made by ``openssl`` in a temporary directory), and one
standalone ``pegaflow-node`` and one ``pegaflow-router`` for their own HTTP servers.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pegaflow.client import SyncPegaClient
from pegaflow.coordinator.suspects import http_alive

from pegaflow.config import ClientConfig, SecurityConfig
from pegaflow.errors import Unauthorized, Unavailable
from pegaflow.keys import NodeRecord
from pegaflow.tls import client_context
from pegaflow.tools.devcluster import REPO, Proc, start, start_node, start_server
from pegaflow.transport.rpc_blocking import BlockingRpcClient
from pegaflow.transport.rpc_client import RpcClient
from tests.support.etcd_fixture import make_test_certs
from tests.support.waiting import wait_for

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

TOKEN = "tls-test-secret"
SIZE = 4096


class Cluster:
    """The server, its CA and token files, and a CA that did not sign its certificate."""

    def __init__(self, server: Proc, certs: Path, other: Path, token_file: Path) -> None:
        self.server = server
        self.address = server.ready["coordinator"]
        self.http = f"127.0.0.1:{server.ready['http']}"
        self.ca = str(certs / "ca.crt")
        self.other_ca = str(other / "ca.crt")
        self.token_file = token_file

    def tls(self, ca: str | None = None) -> ssl.SSLContext | None:
        return client_context(SecurityConfig(tls_ca=ca or self.ca))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    d = tmp_path_factory.mktemp("tls")
    certs, other = make_test_certs(d / "certs"), make_test_certs(d / "other")
    token_file = d / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    server = start_server(
        extra=[
            "--node-pool-bytes", "32MiB", "--node-slab-bytes", "4MiB",
            "--security-tls-cert", str(certs / "server.crt"),
            "--security-tls-key", str(certs / "server.key"),
            "--security-tls-ca", str(certs / "ca.crt"),
            "--security-token-file", str(token_file),
        ]
    )  # fmt: skip
    try:
        yield Cluster(server, certs, other, token_file)
    finally:
        server.terminate()


async def _status(address: str, token: str | None, tls: ssl.SSLContext | None) -> None:
    client = RpcClient([address], token=token, tls=tls, timeout=5)
    try:
        await client.call("status", {})
    finally:
        await client.close()


def test_the_start_line_says_tls_is_on(cluster: Cluster) -> None:
    line = next(ln for ln in cluster.server.log if "security:" in ln)
    assert "TLS on" in line and f"token from {cluster.token_file}" in line, line


async def test_a_client_without_the_ca_is_refused(cluster: Cluster) -> None:
    """Plain TCP, or TLS verified by another CA: the connection never gets to a call."""
    with pytest.raises(Unavailable, match="a TLS server"):
        await _status(cluster.address, TOKEN, None)
    with pytest.raises(Unavailable, match="a TLS server"):
        BlockingRpcClient(cluster.address, token=TOKEN).call("status", {}, timeout=5)
    with pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
        await _status(cluster.address, TOKEN, cluster.tls(cluster.other_ca))
    blocking = BlockingRpcClient(cluster.address, token=TOKEN, tls=cluster.tls(cluster.other_ca))
    with pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
        blocking.call("status", {}, timeout=5)


async def test_a_client_with_the_ca_but_without_the_token_is_refused(cluster: Cluster) -> None:
    with pytest.raises(Unauthorized):
        await _status(cluster.address, None, cluster.tls())
    with pytest.raises(Unauthorized):
        await _status(cluster.address, "wrong", cluster.tls())
    blocking = BlockingRpcClient(cluster.address, token="wrong", tls=cluster.tls())
    with pytest.raises(Unauthorized):
        blocking.call("status", {}, timeout=5)


def test_with_the_ca_and_the_token_a_save_and_a_lookup_work(cluster: Cluster) -> None:
    """Through the loop's client and the blocking one (``lookup_here``), both over TLS."""
    cfg = ClientConfig(coordinators=[cluster.address], lookup_timeout_s=10, rpc_timeout_s=30)
    c = SyncPegaClient(cfg, token=TOKEN, tls=cluster.tls())
    try:
        hashes = [os.urandom(16) for _ in range(4)]
        data = np.random.default_rng(0).integers(0, 255, (4, SIZE), dtype=np.uint8)
        out = c.put_blocks("tls", [(h, 0, data[i]) for i, h in enumerate(hashes)])
        assert out.stored == 4
        wait_for(lambda: c.lookup("tls", hashes).hits == 4, "the blocks to be published")
        assert c.lookup_here("tls", hashes).hits == 4
        assert c._lookup_here.client is not None  # answered by the blocking client
    finally:
        c.close()


def _get(url: str, tls: ssl.SSLContext | None) -> bytes:
    with urllib.request.urlopen(url, timeout=10, context=tls) as r:
        return r.read()


def test_the_http_endpoints_are_https(cluster: Cluster) -> None:
    assert b"pegaflow_" in _get(f"https://{cluster.http}/metrics", cluster.tls())
    status = json.loads(_get(f"https://{cluster.http}/v1/status", cluster.tls()))
    assert [n["node_id"] for n in status["nodes"]] == [cluster.server.ready["node"]]
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _get(f"https://{cluster.http}/metrics", cluster.tls(cluster.other_ca))
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        _get(f"http://{cluster.http}/metrics", None)


async def test_the_coordinators_check_of_a_node_goes_over_https(cluster: Cluster) -> None:
    """A reported node's /health, as the coordinator asks it (verified by its CA)."""
    rec = NodeRecord("n", "127.0.0.1", 0, http=cluster.http)
    assert await http_alive(rec, 5, cluster.tls()) is True
    assert await http_alive(rec, 5, cluster.tls(cluster.other_ca)) is False
    assert await http_alive(rec, 5, None) is False


def test_a_nodes_own_endpoint_is_https(cluster: Cluster) -> None:
    """A ``pegaflow-node`` (no etcd: standalone) serves its HTTP endpoint over TLS too."""
    certs = Path(cluster.ca).parent
    node = start_node("tls-node", pool="32MiB", slab="4MiB", extra=[
        "--security-tls-cert", str(certs / "server.crt"),
        "--security-tls-key", str(certs / "server.key"),
    ])  # fmt: skip
    try:
        url = f"https://127.0.0.1:{node.ready['http']}"
        assert json.loads(_get(f"{url}/health", cluster.tls()))["node_id"] == "tls-node"
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            _get(url.replace("https", "http") + "/health", None)
    finally:
        node.terminate()


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pegaflow.tools.cli", *argv],
        capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_pegaflow_status_over_tls_with_a_token_file(cluster: Cluster) -> None:
    """The CLI's status call and its check of each node's /health go over TLS; a token
    given on the command line is refused, pointing to --token-file."""
    ca = {"PEGAFLOW_SECURITY_TLS_CA": cluster.ca}
    out = _cli("status", "--coordinators", cluster.address, "--token-file",
               str(cluster.token_file), env=ca)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert cluster.server.ready["node"] in out.stdout
    refused = _cli("status", "--coordinators", cluster.address, "--token", TOKEN, env=ca)
    assert refused.returncode == 2 and "--token-file" in refused.stderr, refused.stderr
    unverified = _cli("status", "--coordinators", cluster.address, "--token-file",
                      str(cluster.token_file))  # fmt: skip
    assert unverified.returncode == 2, unverified.stdout


def test_a_router_reports_over_tls_and_serves_https(cluster: Cluster) -> None:
    """A router with the CA and the token file reports to the TLS coordinator; its own
    server speaks TLS, and ``pegaflow status --router`` reads it with the CA."""
    certs = Path(cluster.ca).parent
    router = start("pegaflow-router", [
        "pegaflow.router.main", "--router-port", "0",
        "--router-replicas", "http://127.0.0.1:1",
        "--client-coordinators", cluster.address, "--router-report-interval-s", "0.3",
        "--security-tls-cert", str(certs / "server.crt"),
        "--security-tls-key", str(certs / "server.key"),
        "--security-tls-ca", cluster.ca, "--security-token-file", str(cluster.token_file),
    ])  # fmt: skip
    try:
        url = "https://" + router.ready["address"]

        def listed() -> list[str]:
            status = json.loads(_get(f"https://{cluster.http}/v1/status", cluster.tls()))
            return [r["url"] for r in status["routers"]]

        wait_for(lambda: listed() == [url], "the router's report")
        ca = {"PEGAFLOW_SECURITY_TLS_CA": cluster.ca}
        out = _cli("status", "--coordinators", cluster.address, "--token-file",
                   str(cluster.token_file), "--router", url, env=ca)  # fmt: skip
        assert f"router {url}: mode rr" in out.stdout and "unreachable" not in out.stdout, (
            out.stdout + out.stderr
        )
    finally:
        router.terminate()
