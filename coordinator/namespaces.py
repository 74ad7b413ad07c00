"""Namespaces of one model that cannot share blocks: why an engine gets no hit.

A namespace is ``<model label>.<digest of every factor>`` (:mod:`pegaflow.connector.
namespace`): engines whose model, dtype, KV layout, block size, TP/PP or hash seed
differ write disjoint namespaces, so one gets no hit on what the other stored.  That is
right, but silent.  A connector whose lookups find nothing asks here
(``namespace_peers``), sending its own factors: the coordinator keeps them (in memory,
the most recent :data:`MAX_KEPT` namespaces) and answers with the other namespaces of
the index under the same label that hold blocks, each with its factors when some engine
has sent them to this coordinator, so the connector can log which factor differs.

``namespace_peers`` ``{ns, factors: {name: value}}`` -> ``{peers: [{ns, blocks,
factors}]}`` (at most :data:`MAX_PEERS`; ``factors`` empty when unknown here).  A
tenant's connection may ask only of its own namespaces, and its peers share its
``<tenant>@`` prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pegaflow.protocol.coordinator import NamespacePeersRequest
from pegaflow.protocol.misses import differences

from .index import BlockIndex

MAX_KEPT = 4096
"""namespaces whose factors are kept (least recently sent dropped first)"""
MAX_PEERS = 8
"""peers in one answer"""


def label_of(ns: str) -> str:
    """The model label of a namespace: what precedes its digest."""
    return ns.rsplit(".", 1)[0]


class NamespacePeers:
    """The ``namespace_peers`` op over ``index`` (see the module docstring)."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self._factors: OrderedDict[str, dict[str, str]] = OrderedDict()

    def op_peers(self, args: dict[str, Any]) -> dict[str, Any]:
        """The ``namespace_peers`` op."""
        req = NamespacePeersRequest.from_wire(args)
        ns = req.ns
        if req.factors is not None:
            self.remember(ns, req.factors)
        label = label_of(ns)
        peers = []
        for other in self.index.namespaces():
            if other == ns or label_of(other) != label:
                continue
            blocks = self.index.blocks_in(other)
            if blocks:
                known = self._factors.get(other, {})
                peers.append({"ns": other, "blocks": blocks, "factors": known})
            if len(peers) >= MAX_PEERS:
                break
        return {"peers": peers}

    def remember(self, ns: str, factors: dict[str, str]) -> None:
        """Keep ``factors`` (checked: :class:`NamespacePeersRequest`) as ``ns``'s."""
        self._factors[ns] = factors
        self._factors.move_to_end(ns)
        while len(self._factors) > MAX_KEPT:
            self._factors.popitem(last=False)

    def differing(self, ns: str, other: str) -> list[str]:
        """The factors in which ``ns`` and ``other`` differ, as
        :func:`~pegaflow.protocol.misses.differences` says them (empty while either's
        engines have not sent theirs)."""
        mine, theirs = self._factors.get(ns), self._factors.get(other)
        return differences(mine, theirs) if mine and theirs else []
