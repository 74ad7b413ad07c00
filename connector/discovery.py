"""Which storage node runs on the engine's own host: found by the connector itself.

The node on this host is the one to save to and the one whose pool file the same-host
path and layer-wise loads copy straight from.  The connector finds it with no
configuration: among every node the coordinator knows, the one whose pool file (offered
in the node's data-plane handshake: path, device and inode) this process can open as
that very file (:meth:`pegaflow.client.PegaClient.local_nodes`).  That is true of the
node inside ``pegaflow-server`` and of the ``pegaflow-node`` of this host in a cluster,
and false of every other host's node, of a node in another mount namespace, and of a
node that offers its pool to no one (``[node] local_access = false``).  The client's
session with the node found (:meth:`pegaflow.client.PegaClient.session`) is then told
its pool file and control socket, so the same-host path asks its ops straight over the
socket.

The ``local_node`` setting overrides the search.  When several nodes on this host
qualify (test clusters), the largest pool wins, then the smallest id: every process of
an engine picks the same one.

Runs at engine start, in the background, within ``rpc_timeout_s``; when it finds no node
(none yet: say the node starts after the engine) it looks again, at most every
:data:`RETRY_S` seconds, while the engine runs.

Pure module: no vLLM or torch import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass
from typing import Any

from pegaflow.client.samehost import PoolFile

from pegaflow.units import human_bytes

logger = logging.getLogger("pegaflow.connector")

RETRY_S = 30.0
"""least time between two searches while no node has been found"""


@dataclass(eq=False, repr=False)
class LocalNodeFinder:
    """The node on this host: ``override`` when set, else the one :meth:`find` found.

    Args:
        override: the ``local_node`` setting ('' to search).
        timeout: deadline of one search (the coordinator's answer and every handshake).
        announce: log what was found at INFO (the scheduler side; workers log at DEBUG).
        retry_s: least time between two searches while none has been found.
        clock: monotonic clock (tests inject one).
    """

    override: str
    timeout: float
    announce: bool = False
    retry_s: float = RETRY_S
    clock: InitVar[Callable[[], float]] = time.monotonic

    def __post_init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._found = ""
        self.pool: PoolFile | None = None
        """the found node's pool file (None with an override or when none was found)"""
        self._done = threading.Event()
        """set once a first search finished (at once with an override)"""
        self._lock = threading.Lock()
        self._searching = False
        self._last = -1e18
        self._searches = 0
        if self.override:
            self._done.set()

    @property
    def node(self) -> str:
        """The node id on this host ('' while none is known)."""
        return self.override or self._found

    @property
    def settled(self) -> bool:
        """Whether a first search finished (always, with an override)."""
        return self._done.is_set()

    def wait(self, timeout: float) -> str:
        """Wait up to ``timeout`` for the first search; returns :attr:`node`."""
        self._done.wait(timeout)
        return self.node

    def find(self, client: Any) -> str:
        """Search now (blocking, up to :attr:`timeout`) unless a node is known; returns
        :attr:`node`.  ``client``: a :class:`~pegaflow.client.SyncPegaClient`."""
        if self.node:
            return self.node
        first = self._searches == 0
        self._searches += 1
        level = logging.INFO if self.announce and first else logging.DEBUG
        t0 = self._last = self._clock()
        try:
            return self._search(client, level, first, t0)
        finally:  # waiters wake once the outcome is recorded and logged
            self._last = self._clock()
            self._done.set()

    def _search(self, client: Any, level: int, first: bool, t0: float) -> str:
        try:
            found = list(client.local_nodes(timeout=self.timeout))
        except Exception as e:
            logger.log(
                level,
                "PegaFlow: could not look for a storage node on this host (%s: %s); looking "
                "again within %.0f s",
                type(e).__name__, e, self.retry_s,
            )  # fmt: skip
            return ""
        if not found:
            logger.log(
                level if first else logging.DEBUG,
                "PegaFlow: no storage node on this host among those the coordinator knows "
                "(%s): saves go where the coordinator places them and every hit loads over "
                "the network (UCX), which the connector claims only when it is expected to "
                "be faster than recomputing it. Run pegaflow-node (or pegaflow-server) on "
                "this host, or set local_node; looking again within %.0f s",
                self._known(client), self.retry_s,
            )  # fmt: skip
            return ""
        best = found[0]
        others = [n.record.node_id for n in found[1:]]
        logger.log(
            logging.INFO if self.announce or not first else logging.DEBUG,
            "PegaFlow: same-host node %s found: pool %s (%s), in %.0f ms; saves, same-host "
            "loads and layer-wise loads use it%s",
            best.record.node_id, best.pool.path, human_bytes(best.pool.size),
            (self._clock() - t0) * 1e3,
            f" (also on this host: {', '.join(others)}; local_node picks another)"
            if others else "",
        )  # fmt: skip
        self._found, self.pool = best.record.node_id, best.pool
        return self.node

    def _known(self, client: Any) -> str:
        try:
            nodes = client.nodes(timeout=self.timeout)
        except Exception:
            return "the coordinator did not list them"
        if not nodes:
            return "it knows none"
        return ", ".join(f"{n.node_id} at {n.ucx_address}" for n in nodes.values())

    def maybe_retry(self, search: Callable[[], None]) -> None:
        """Run ``search`` (which calls :meth:`find`) on a thread of its own when no node
        is known, none is being searched for and the last search is ``retry_s`` old."""
        if self.node:
            return
        with self._lock:
            if self._searching or self._clock() - self._last < self.retry_s:
                return
            self._searching = True

        def run() -> None:
            try:
                search()
            except Exception as e:  # never let a background search take anything down
                logger.debug("PegaFlow: search for the same-host node failed: %s", e)
            finally:
                with self._lock:
                    self._searching = False

        threading.Thread(target=run, name="pegaflow-discovery", daemon=True).start()
