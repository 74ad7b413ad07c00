"""Engine-start connections of the scheduler side, made before the first lookup.

At engine start, on a background thread, the scheduler finds the storage node on its
host and connects to the coordinator and to that node, by a locate and a lookup of a
block nobody has: the first lookup would otherwise pay for the connections and every
first use on its path, and past ``lookup_timeout_s`` its request would miss the cache.
A lookup made before that is done waits for it (up to ``WARM_UP_WAIT_S``).

Pure module: no vLLM import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass

from ..discovery import LocalNodeFinder
from ..policy import WARM_UP_WAIT_S
from ..settings import ConnectorSettings
from .schedclient import ClusterClient

logger = logging.getLogger("pegaflow.connector")

WARM_UP_NS = "pegaflow.warm-up"
"""the namespace of the lookups made at engine start (it holds nothing)"""


@dataclass(eq=False, repr=False)
class WarmUp:
    """The scheduler's engine-start connections and the wait of early lookups for them.

    Args:
        settings: connector settings.
        shards: the engine's shards (the warm-up lookup asks for each).
        cluster: the cluster client.
        finder: finds the storage node on this host.
        clock: monotonic clock (tests inject one).
    """

    settings: ConnectorSettings
    shards: list[int]
    cluster: ClusterClient
    finder: LocalNodeFinder
    clock: InitVar[Callable[[], float]]

    def __post_init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._connected = threading.Event()
        """clear while :meth:`start`'s connections are being made"""
        self._connected.set()

    def start(self) -> None:
        """:meth:`run` on a background thread (engine start); lookups made before it is
        done wait for it, up to ``WARM_UP_WAIT_S``, rather than miss."""
        self._connected.clear()

        def run() -> None:
            try:
                self.run()
            finally:
                self._connected.set()

        threading.Thread(target=run, name="pegaflow-warm-up", daemon=True).start()

    def run(self) -> None:
        """Find the node on this host (unless ``local_node`` names it), then connect to
        the coordinator and to that node now, by a locate and a lookup of a block nobody
        has."""
        if self.settings.mode == "off":
            return
        client = self.cluster.get()
        if client is None:
            return
        t0 = time.monotonic()
        node = self.finder.find(client)
        if not self.settings.can_load:
            return
        timeout = self.settings.rpc_timeout_s
        probe = [bytes(32)]  # a block nobody stores, in a namespace of its own
        try:
            if node:  # fetches the node records, opens the data plane and control socket
                client.locate_here(WARM_UP_NS, node, probe, 0, 0.001, timeout)
            # flagged: the coordinator leaves it out of its lookup counts
            client.lookup_here(WARM_UP_NS, probe, self.shards, timeout, warm_up=True)
            logger.debug("PegaFlow: connected in %.1f ms", (time.monotonic() - t0) * 1e3)
        except Exception as e:
            logger.info("PegaFlow: could not connect ahead of the first lookup: %s", e)

    def before_lookup(self, req_id: str) -> None:
        """Before a lookup: wait for the engine-start connections still being made (the
        engine took a request right after creating the connector: waiting is cheaper
        than a miss), else search again for this host's node when that is due."""
        if self._connected.is_set():
            self.finder.maybe_retry(lambda: self.finder.find(self.cluster.get()))
            return
        t = self._clock()
        self._connected.wait(min(WARM_UP_WAIT_S, self.settings.rpc_timeout_s))
        logger.debug(
            "PegaFlow: %s waited %.1f ms for the engine-start connections",
            req_id, (self._clock() - t) * 1e3,
        )  # fmt: skip
