"""The documented metric families, and requests that metrics endpoints must refuse."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from pegaflow.client import PegaClient

from pegaflow.errors import BadRequest
from pegaflow.transport.rpc_client import RpcClient

REPO = Path(__file__).resolve().parents[2]
BLOCK = 64 << 10
NS = "metrics-model"


def documented() -> dict[str, dict[str, str]]:
    """``{section: {exposed name: type}}`` from the tables of docs/metrics.md (the
    services' ``pegaflow_*`` names and the connector's ``vllm:pegaflow_*`` names)."""
    out: dict[str, dict[str, str]] = {}
    section = ""
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip().lower()
        m = re.match(r"^\| `((?:vllm:)?pegaflow_[a-z0-9_]+)` \| (counter|gauge|histogram) \|", line)
        if m:
            out.setdefault(section, {})[m.group(1)] = m.group(2)
    return out


def family_name(name: str, typ: str) -> str:
    return name[: -len("_total")] if typ == "counter" else name


async def malformed_requests(
    client: PegaClient, ucx: str, coordinator: str, h: bytes, ns: str = NS
) -> None:
    """A malformed data-plane request (a bad namespace: a miss) and a malformed control
    request (a typed error), for the error metrics to count."""
    wrong = np.zeros(BLOCK, dtype=np.uint8)
    assert await client._data.get(ucx, "bad/ns", [(h, 0, wrong)], 5) == [False]
    rpc = RpcClient([coordinator], timeout=5)
    try:
        with pytest.raises(BadRequest):
            await rpc.call("lookup", {"ns": ns, "hashes": "not a list"})
    finally:
        await rpc.close()
