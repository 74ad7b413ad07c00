"""The blocking client: each operation of the asyncio client, run on its loop thread.

:class:`SyncPegaClient` runs a :class:`~.api.PegaClient` on a private event-loop thread
for synchronous callers (the vLLM connector, scripts).

Each of its operations is declared here from the async one (:class:`~.calls.blocking`,
:class:`~.calls.submitted`) and runs it on the loop through one helper
(:class:`~.calls.OnLoop`): ``op(...)`` blocks for the answer, ``submit_op(...)``
returns a future of it; the gets copy into the caller's buffers on its side
(:class:`~.calls.blocking_get`), and the ``*_here`` calls are written out.
Deadlines are made on the caller's thread and carried across the hop to the loop
(:func:`~.calls.deadline_of`, :mod:`pegaflow.deadline`)."""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import uvloop

from pegaflow.config import ClientConfig
from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import DeadlineExceeded
from pegaflow.protocol.codec import LocatedBlocks
from pegaflow.protocol.coordinator import LookupRequest, LookupResult, Op

from .api import PegaClient
from .calls import OnLoop, blocking, blocking_get, deadline_of, submitted, submitted_get
from .nodehealth import NodeHealth
from .session import NodeSession
from .sync_session import LOOP, Here, SyncNodeSession

T = TypeVar("T")


class SyncPegaClient(OnLoop):
    """A thread-safe, blocking facade over a :class:`PegaClient` on its own loop thread.

    Every operation of :class:`PegaClient` is here with its signature: ``op(...)`` blocks
    until the answer; ``submit_op(...)`` returns a
    :class:`concurrent.futures.Future` of it at once.  The call's deadline is made from
    its ``timeout`` on the caller's thread and carried to the loop (a
    :class:`~pegaflow.deadline.Deadline` passed as ``timeout`` is carried as it is),
    so the wait for the loop counts against it; a blocking call waits at most
    :data:`~pegaflow.deadline.HOP_MARGIN_S` past it.  :meth:`node_session` gives the
    same for one node's ops.
    """

    def __init__(
        self, cfg: ClientConfig, token: str | None = None, *, tls: ssl.SSLContext | None = None
    ) -> None:
        # uvloop: a call from another thread reaches the loop and comes back faster than
        # on asyncio's own loop (52 / 264 us p50 / p90 against 84 / 774 us, one-off probe;
        # docs/benchmarks.md, "Same-host control")
        super().__init__(cfg, uvloop.new_event_loop())
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pegaflow-client", daemon=True
        )
        self._thread.start()
        self._client: PegaClient = self._wait(
            self._submit(self._make(cfg, token, tls)), Deadline.of(cfg.rpc_timeout_s)
        )
        self._target = self._client
        self._node_sessions: dict[str, SyncNodeSession] = {}
        self._sessions_lock = threading.Lock()
        self._token = token
        self._lookup_here = Here(token, tls)
        self._lookup_failed = False
        """the last :meth:`lookup_here` passed its deadline: the next goes through the loop"""

    @staticmethod
    async def _make(
        cfg: ClientConfig, token: str | None, tls: ssl.SSLContext | None
    ) -> PegaClient:
        return PegaClient(cfg, token, tls=tls)

    def open_transfers(self) -> None:
        """:meth:`PegaClient.open_transfers` on the loop, waited for (the caller's thread
        blocks while UCX opens the worker)."""
        self._wait(self._submit(self._open_transfers()), Deadline.of(self.cfg.rpc_timeout_s))

    async def _open_transfers(self) -> None:
        self._client.open_transfers()

    def _on_loop(self, fn: Callable[[PegaClient], Coroutine[Any, Any, T]], timeout: float) -> T:
        """``fn(async_client)`` on the loop, waited for: only for tests that reach into
        the async client's internals (callers use the operations)."""
        return self._wait(self._submit(fn(self._client)), Deadline.of(timeout))

    # ---- the operations of PegaClient, blocking (and as futures) ---------------------

    lookup = blocking(PegaClient.lookup)  # through the loop; see lookup_here
    submit_lookup = submitted(PegaClient.lookup)
    place = blocking(PegaClient.place)
    submit_place = submitted(PegaClient.place)
    status = blocking(PegaClient.status)
    submit_status = submitted(PegaClient.status)
    nodes = blocking(PegaClient.nodes)
    submit_nodes = submitted(PegaClient.nodes)

    get_blocks = blocking_get(PegaClient.get_blocks, PegaClient._fetch_blocks)
    submit_get_blocks = submitted_get(PegaClient.get_blocks, PegaClient._fetch_blocks)
    pin_blocks = blocking(PegaClient.pin_blocks)
    submit_pin_blocks = submitted(PegaClient.pin_blocks)
    put_blocks = blocking(PegaClient.put_blocks)
    submit_put_blocks = submitted(PegaClient.put_blocks)
    drop = blocking(PegaClient.drop)
    submit_drop = submitted(PegaClient.drop)
    local_pool = blocking(PegaClient.local_pool)
    submit_local_pool = submitted(PegaClient.local_pool)
    local_nodes = blocking(PegaClient.local_nodes)
    submit_local_nodes = submitted(PegaClient.local_nodes)
    locate = blocking(PegaClient.locate)  # through the loop; see locate_here
    submit_locate = submitted(PegaClient.locate)
    unpin = blocking(PegaClient.unpin)
    submit_unpin = submitted(PegaClient.unpin)
    report_lookups = blocking(PegaClient.report_lookups)
    submit_report_lookups = submitted(PegaClient.report_lookups)
    reserve_local = blocking(PegaClient.reserve_local)
    submit_reserve_local = submitted(PegaClient.reserve_local)
    commit_local = blocking(PegaClient.commit_local)  # on_taken runs on the loop
    submit_commit_local = submitted(PegaClient.commit_local)
    abort_local = blocking(PegaClient.abort_local)
    submit_abort_local = submitted(PegaClient.abort_local)
    namespace_peers = blocking(PegaClient.namespace_peers)
    submit_namespace_peers = submitted(PegaClient.namespace_peers)
    report_unreachable = blocking(PegaClient.report_unreachable)
    submit_report_unreachable = submitted(PegaClient.report_unreachable)
    report_misses = blocking(PegaClient.report_misses)
    submit_report_misses = submitted(PegaClient.report_misses)

    def node_session(self, node_id: str) -> SyncNodeSession:
        """The blocking facade of :meth:`PegaClient.session` (one per node, kept)."""
        s = self._node_sessions.get(node_id)
        if s is None:
            with self._sessions_lock:
                s = self._node_sessions.get(node_id)
                if s is None:
                    fut = self._submit(self._session_of(node_id))
                    session = self._wait(fut, Deadline.of(self.cfg.rpc_timeout_s))
                    s = self._node_sessions[node_id] = SyncNodeSession(self, session)
        return s

    def locate_here(
        self,
        ns: str,
        node_id: str,
        hashes: Sequence[bytes],
        shard: int = 0,
        ttl_s: float = 5.0,
        timeout: Timeout = None,
    ) -> tuple[int, LocatedBlocks]:
        """:meth:`locate`, asked from the calling thread (:meth:`SyncNodeSession.locate_here`)."""
        return self.node_session(node_id).locate_here(ns, hashes, shard, ttl_s, timeout)

    def lookup_here(
        self,
        ns: str,
        hashes: Sequence[bytes],
        shards: Sequence[int] = (0,),
        timeout: Timeout = None,
        generations: bool = False,
        warm_up: bool = False,
    ) -> LookupResult:
        """:meth:`lookup` asked from the calling thread, as :meth:`locate_here` asks a
        node: over a blocking connection of its own to the coordinator the client talks
        to now, keeping the GIL through the round trip; through the loop when that
        connection fails, and for the call after one that failed (the loop's client
        fails over to the next coordinator when one hangs or goes away)."""
        deadline = deadline_of(self.cfg, self._client.lookup, timeout)
        if not hashes:
            return LookupResult(0)
        if self._lookup_failed:
            self._lookup_failed = False
            return self.lookup(ns, hashes, shards, deadline, generations, warm_up)
        args = LookupRequest(ns, list(hashes), list(shards), generations, warm_up).to_wire()
        try:
            address = self._client.coordinator_address
            res = self._lookup_here.call(address, Op.LOOKUP, args, deadline)
        except DeadlineExceeded:
            self._lookup_failed = True
            raise
        if res is LOOP:
            return self.lookup(ns, hashes, shards, deadline, generations, warm_up)
        got = LookupResult.from_wire(res, len(shards), generations)
        if got.nodes:
            self._loop.call_soon_threadsafe(self._client.learn_nodes, got.nodes)
        return got

    async def _session_of(self, node_id: str) -> NodeSession:
        return self._client.session(node_id)

    def settled(self, buf: Any) -> bool:
        """See :meth:`PegaClient.settled`."""
        return self._client.settled(buf)

    @property
    def stale_misses(self) -> int:
        """See :attr:`PegaClient.stale_misses`."""
        return self._client.stale_misses

    @property
    def health(self) -> NodeHealth:
        """See :attr:`PegaClient.health` (thread-safe: the connector's scheduler reads
        which nodes are down from its own thread)."""
        return self._client.health

    async def _shutdown(self) -> None:
        await self._client.close()
        # calls still in flight (fire-and-forget unpins, say) end here, not in the GC
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def close(self) -> None:
        """Close the client and stop its thread."""
        if not self._loop.is_running():
            return
        for s in list(self._node_sessions.values()):
            s.close_here()
        self._lookup_here.close()
        try:
            self._wait(self._submit(self._shutdown()), Deadline.of(5.0))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()
