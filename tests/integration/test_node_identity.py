"""The node that answers at an address must be the node the caller meant (issue 35).

Two nodes that publish one address (a loopback or wildcard ``--node-host`` in a cluster
of several hosts): from a third host, the record of one node leads to whichever node
listens at that address on the caller's own host.  Against two real ``pegaflow-node``
processes (real UCX), a client is given a record of node ``alpha`` that carries node
``beta``'s address, as such a client would read it from etcd.  Then:

* a put addressed to ``alpha`` raises :class:`~pegaflow.errors.WrongPeer` naming both
  nodes and the address, and nothing is stored on ``beta``;
* a get from ``alpha`` gives misses (gets never raise for a node's failures), even for
  blocks ``beta`` holds, and says why at WARNING, once;
* the search for this host's nodes leaves ``alpha`` out;
* ``pegaflow status`` and the dashboard show ``alpha`` as not ok;
* correct records (and a caller that only knows an address) work as before.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from pegaflow.client import PegaClient
from pegaflow.client.data import DataClient
from pegaflow.client.session import NodeSession

from pegaflow.config import ClientConfig
from pegaflow.errors import Unavailable, WrongPeer
from pegaflow.keys import NodeRecord
from pegaflow.tools.cli import WRONG_NODE, node_health, render_status
from pegaflow.tools.dashboard import Dashboard
from pegaflow.tools.devcluster import Proc, start_node

pytestmark = pytest.mark.ucx

NS = "test-node-identity"
SIZE = 4096
SMALL = {"pool": "32MiB", "slab": "4MiB"}


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Proc]]:
    procs: dict[str, Proc] = {}
    try:
        for nid in ("alpha", "beta"):
            procs[nid] = start_node(nid, **SMALL)  # standalone: the records are the test's
        yield procs
    finally:
        for p in procs.values():
            p.terminate()


def record(p: Proc, **change: Any) -> NodeRecord:
    """The record node ``p`` would publish (with ``change``)."""
    host, _, port = p.ready["ucx"].rpartition(":")
    rec = NodeRecord(p.ready["node"], host, int(port), http=f"{host}:{p.ready['http']}")
    return replace(rec, **change)


def misaddressed(nodes: dict[str, Proc]) -> dict[str, NodeRecord]:
    """alpha's record names beta's addresses; beta's is right."""
    beta = record(nodes["beta"])
    return {"alpha": record(nodes["alpha"], ucx_port=beta.ucx_port, http=beta.http), "beta": beta}


def client(recs: dict[str, NodeRecord]) -> PegaClient:
    """A client that knows ``recs`` (no coordinator is asked)."""
    c = PegaClient(ClientConfig(coordinators=["127.0.0.1:1"], transfer_timeout_s=5.0))
    c.learn_nodes(recs)
    return c


def blocks(n: int) -> list[tuple[bytes, int, Any]]:
    return [(os.urandom(16), 0, np.frombuffer(os.urandom(SIZE), np.uint8)) for _ in range(n)]


def buffers(n: int) -> list[np.ndarray]:
    return [np.zeros(SIZE, np.uint8) for _ in range(n)]


async def test_a_put_to_a_node_that_another_node_answers_for_is_refused(
    nodes: dict[str, Proc], caplog: pytest.LogCaptureFixture
) -> None:
    recs = misaddressed(nodes)
    addr = recs["alpha"].ucx_address
    c = client(recs)
    try:
        items = blocks(3)
        with pytest.raises(WrongPeer) as err:
            await c.put_blocks(NS, items, node_id="alpha")
        msg = str(err.value)
        assert "alpha" in msg and "beta" in msg and addr in msg and "--node-host" in msg
        assert isinstance(err.value, Unavailable)  # callers that handle a down node still do
        # nothing reached beta
        keys = [(h, s, None) for h, s, _ in items]
        assert await c.session("beta").check(NS, keys) == [False] * 3
        # and again: the kept connection is checked on every call
        with pytest.raises(WrongPeer):
            await c.put_blocks(NS, items, node_id="alpha")
        with pytest.raises(WrongPeer):
            await c.session("alpha").check(NS, keys)
        with pytest.raises(WrongPeer):
            await c.session("alpha").pool_file()
        assert await c.session("beta").check(NS, keys) == [False] * 3

        # the blocks on beta, put there by a caller that means beta
        assert (await c.put_blocks(NS, items, node_id="beta")).stored == 3
        # a get from alpha gives misses, even though beta (answering there) holds them
        caplog.set_level(logging.INFO, "pegaflow.client")
        caplog.clear()
        for _ in range(3):
            bufs = buffers(3)
            got = await c.get_blocks(
                NS, [("alpha", h, s, b) for (h, s, _), b in zip(items, bufs, strict=True)]
            )
            assert got == [False] * 3 and not any(b.any() for b in bufs)
        warned = [
            r for r in caplog.records if r.levelno == logging.WARNING and "beta" in r.getMessage()
        ]
        assert len(warned) == 1, caplog.text  # once, not once per get
        assert "alpha" in warned[0].getMessage() and addr in warned[0].getMessage()
        # pins and pin-less reads of beta's blocks through alpha's record: refused too
        assert await c.pin_blocks(NS, [("alpha", h, s) for h, s, _ in items]) == [False] * 3

        # beta itself: the same connection (same address) serves it
        bufs = buffers(3)
        got = await c.get_blocks(
            NS, [("beta", h, s, b) for (h, s, _), b in zip(items, bufs, strict=True)]
        )
        assert got == [True] * 3
        assert all((b == x).all() for b, (_, _, x) in zip(bufs, items, strict=True))
    finally:
        await c.close()


async def test_correct_records_and_address_only_callers_work(nodes: dict[str, Proc]) -> None:
    recs = {nid: record(p) for nid, p in nodes.items()}
    c = client(recs)
    try:
        items = blocks(2)
        assert (await c.put_blocks(NS, items, node_id="alpha")).stored == 2
        keys = [(h, s, None) for h, s, _ in items]
        assert await c.session("alpha").check(NS, keys) == [True] * 2
        assert await c.session("beta").check(NS, keys) == [False] * 2
        bufs = buffers(2)
        got = await c.get_blocks(
            NS, [("alpha", h, s, b) for (h, s, _), b in zip(items, bufs, strict=True)]
        )
        assert got == [True] * 2
    finally:
        await c.close()
    # a caller that knows only an address takes whichever node answers there
    data = DataClient()
    s = NodeSession.at(recs["beta"].ucx_address, data)
    try:
        assert await s.check(NS, [(h, sh, None) for h, sh, _ in items], 5.0) == [False] * 2
        assert await data.node_id(recs["beta"].ucx_address, 5.0) == "beta"
    finally:
        s.close()
        await data.close()


async def test_the_search_for_this_hosts_nodes_leaves_a_misaddressed_node_out(
    nodes: dict[str, Proc], caplog: pytest.LogCaptureFixture
) -> None:
    recs = misaddressed(nodes)
    c = client(recs)

    async def from_etcd(timeout: Any = None) -> dict[str, NodeRecord]:
        return dict(recs)  # as a coordinator would answer

    c.nodes = from_etcd  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, "pegaflow.client")
    try:
        found = await c.local_nodes(timeout=5.0)
    finally:
        await c.close()
    assert [n.record.node_id for n in found] == ["beta"]
    assert "alpha" in caplog.text and "beta" in caplog.text


async def test_status_and_dashboard_show_a_misaddressed_node_as_not_ok(
    nodes: dict[str, Proc],
) -> None:
    recs = misaddressed(nodes)
    docs = [r.to_wire() for r in recs.values()]
    health = await node_health(docs, 5.0)
    assert health == {"alpha": WRONG_NODE + "beta", "beta": "ok"}
    out = render_status({"nodes": docs}, health)
    assert "health: NOT ok: alpha" in out and "node beta answers" in out

    async def status() -> dict[str, Any]:
        return {"nodes": docs, "blocks": 0, "coordinator": {"id": "t"}}

    dash = Dashboard(status, None, scrape_timeout_s=5.0)
    try:
        await dash.sample()
        doc = dash.snapshot()
    finally:
        await dash.close()
    by_id = {n["node_id"]: n for n in doc["nodes"]}
    assert by_id["beta"]["health"] == "ok"
    alpha = by_id["alpha"]
    assert alpha["health"] == "wrong node" and "node beta answers" in alpha["error"]
    assert alpha["blocks"] == 0  # none of beta's numbers are taken for alpha
    assert doc["cluster"]["nodes_ok"] == 1
