"""A storage node with the cluster token and two tenants, and reading its ``/metrics``."""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pegaflow.protocol.codec import PROTOCOL_VERSION, pack
from pegaflow.tools.devcluster import Proc, start_node
from tests.support.cluster import RawConn

TENANTS = "acme=a-secret,globex=g-secret"
POOL = 32 << 20  # 128 blocks of BLOCK


def tenant_node(procs: list[Proc], name: str, *extra: str, pool: int = POOL) -> Proc:
    """A node with the cluster token ``admin`` and the tenants acme and globex."""
    node = start_node(
        name, pool=str(pool), slab="4MiB", token="admin", tenants=TENANTS, extra=extra,
    )  # fmt: skip
    procs.append(node)
    return node


def scrape(http_port: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
        return r.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a ``/metrics`` text (0 when absent)."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


async def raw_conn(addr: str, token: str | None) -> RawConn:
    """A bare UCX connection, authenticated with ``token`` unless None."""
    raw = await RawConn.open(addr)
    if token is not None:
        reply = await raw.ask(pack({"op": "hello", "id": 0, "version": PROTOCOL_VERSION,
                                    "token": token}))  # fmt: skip
        assert reply["ok"], reply
    return raw


def error_code(reply: dict[str, Any]) -> str:
    assert reply["ok"] is False, reply
    return reply["error"]["code"]
