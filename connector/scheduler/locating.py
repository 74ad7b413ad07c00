"""Same-host locates: where this host's node holds the looked-up blocks, pinned.

With layer-wise loads from this host's node, the scheduler asks the node where the
blocks are (and pins them) before anything else, one call per shard, so the workers can
start copying without a round trip of their own; when the node holds every asked block
the lookup is answered without the coordinator.  Failing locates pause for a while (a
circuit breaker), so a sick node costs lookups no more than a deadline.  Blocks on
other nodes get read pins instead (fire and forget).

Pure module: no vLLM import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass
from typing import Any

import numpy as np

from pegaflow.deadline import Deadline

from ..discovery import LocalNodeFinder
from ..policy import LOCATE_PIN_S, MAX_LOCATE, CircuitBreaker
from ..settings import ConnectorSettings
from .reqstate import Lookup
from .schedclient import ClusterClient

logger = logging.getLogger("pegaflow.connector")


def on_node(nodes: list[list[str]], node: str, world_size: int) -> bool:
    """Whether every shard of every block lies on ``node``."""
    return nodes.count([node] * world_size) == len(nodes)


@dataclass(eq=False, repr=False)
class Locator:
    """Locates, pins and unpins looked-up blocks for the scheduler side.

    Args:
        settings: connector settings.
        world_size: shards per block.
        cluster: the cluster client.
        finder: finds the storage node on this host.
        clock: monotonic clock (tests inject one).
    """

    settings: ConnectorSettings
    world_size: int
    cluster: ClusterClient
    finder: LocalNodeFinder
    clock: InitVar[Callable[[], float]]

    def __post_init__(self, clock: Callable[[], float]) -> None:
        self.shards = list(range(self.world_size))
        self._clock = clock
        self.breaker = CircuitBreaker.of(self.settings, clock)
        """pauses locates while they fail"""

    @property
    def local_node(self) -> str:
        """The node on this host ('' while none is known)."""
        return self.finder.node

    def all_local(self, lk: Lookup) -> bool:
        """Whether the hit loads layer-wise from this host's node (every shard on it)."""
        s = self.settings
        local = self.local_node
        if not (s.layerwise and s.same_host_shortcut and local):
            return False
        return on_node(lk.nodes, local, self.world_size)

    def locate(self, client: Any, ns: str, asked: list[bytes]) -> list[Any] | None:
        """Ask this host's node where the blocks are, pinning them; per shard
        ``(pin, LocatedBlocks)``, or None (not asked, or failed).  Only when the node
        lacks some is the coordinator asked: a lookup sent alongside delayed every whole
        local hit (both answers share the client's loop; docs/benchmarks.md, "Same-host
        control")."""
        s = self.settings
        node = self.local_node
        if not (s.layerwise and s.same_host_shortcut and node and client is not None):
            return None
        if not self.breaker.allow():
            return None
        part = asked[:MAX_LOCATE]
        try:
            deadline = Deadline.after(s.lookup_timeout_s)
            # from this thread, shard after shard: no wait for the client's loop thread
            got = [
                client.locate_here(ns, node, part, shard, LOCATE_PIN_S, deadline)
                for shard in self.shards
            ]
        except Exception as e:
            self.breaker.failure()
            self.cluster.log_error("locate failed", e)
            return None
        self.breaker.success()
        return got

    def answer_locally(
        self, start: int, n_hashes: int, asked: list[bytes], located: list[Any]
    ) -> Lookup | None:
        """A lookup answered by the local node alone: when its locates found every asked
        block of every shard (else None: the coordinator's answer is needed)."""
        local = self.local_node
        lk = Lookup(self._clock(), start, n_hashes, len(asked), [[local] * self.world_size
                    for _ in asked])  # fmt: skip
        self.keep_located(lk, located)
        if not lk.located or lk.hits != len(asked):
            return None
        gen_cols = [where.column("gen").tolist() for where in lk.located]
        lk.gens = [list(g) for g in zip(*gen_cols, strict=True)]
        return lk

    def keep_located(self, lk: Lookup, got: list[Any]) -> None:
        """Keep the locations when every hit is on this host's node; the hits shrink to
        the prefix the node located with the generations the lookup saw."""
        if not lk.hits or not on_node(lk.nodes, self.local_node, self.world_size):
            return  # not a layer-wise load: the pins expire on their own
        n = lk.hits
        for shard, (_pin, where) in enumerate(got):
            m = min(n, len(where))
            ok = where.found[:m]
            if len(lk.gens) >= m:
                want = np.array([g[shard] for g in lk.gens[:m]], dtype=np.uint64)
                ok = ok & (where.column("gen")[:m] == want)
            bad = np.flatnonzero(~ok)
            n = int(bad[0]) if len(bad) else m
        if n <= 0:
            return
        lk.hits = n
        lk.nodes = lk.nodes[:n]
        lk.gens = lk.gens[:n]
        lk.located = [where[:n] for _pin, where in got]
        lk.pins = [int(pin) for pin, _where in got]
        lk.located_at = time.monotonic()

    def pin(self, client: Any, ns: str, hashes: Sequence[bytes], nodes: list[list[str]]) -> None:
        """Read pins: ask the nodes to keep the hit blocks from eviction until the load
        (fire and forget; a lost pin only means a possible miss, never wrong bytes)."""
        if client is None:
            return
        items = [
            (node, h, shard)
            for h, row in zip(hashes, nodes, strict=True)
            for shard, node in enumerate(row)
        ]
        try:
            client.submit_pin_blocks(ns, items, self.settings.read_pin_s)
        except Exception as e:
            self.cluster.log_error("read pin failed", e)

    def unpin(self, pins: list[int]) -> None:
        """Release the local node's pins of a locate whose blocks will not be loaded
        (fire and forget: an unpin lost only keeps them from eviction a little longer)."""
        client, node = self.cluster.get(), self.local_node
        if client is None or not node:
            return
        timeout = self.settings.rpc_timeout_s
        for pin in pins:
            try:
                client.submit_unpin(node, pin, timeout)
            except Exception as e:
                logger.debug("PegaFlow: unpin failed: %s", e)
