"""The blocking client: :class:`SyncPegaClient` runs a :class:`~.api.PegaClient` on a
private event-loop thread for synchronous callers (the vLLM connector, scripts) and
offers each of its operations twice, built from it by one helper
(:func:`~.calls.offer`): ``op(...)`` blocks for the answer, ``submit_op(...)`` returns a
future.  Deadlines are made on the caller's thread and carried across the hop to the
loop (:mod:`pegaflow.deadline`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import uvloop

from pegaflow.config import ClientConfig
from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import DeadlineExceeded, Unavailable
from pegaflow.protocol import node as proto
from pegaflow.protocol.codec import LocatedBlocks
from pegaflow.protocol.coordinator import LookupRequest, LookupResult, Op
from pegaflow.transport.rpc_client import BlockingRpcClient

from .api import PegaClient
from .calls import OnLoop, offer
from .nodehealth import NodeHealth
from .session import NodeSession

T = TypeVar("T")


class SyncPegaClient(OnLoop):
    """A thread-safe, blocking facade over a :class:`PegaClient` on its own loop thread.

    Every operation of :class:`PegaClient` is here twice, with its signature: ``op(...)``
    blocks until the answer, ``submit_op(...)`` returns a
    :class:`concurrent.futures.Future` of it at once (:func:`~.calls.offer`).  The call's
    deadline is made from its ``timeout`` on the caller's thread and carried to the loop
    (a :class:`~pegaflow.deadline.Deadline` passed as ``timeout`` is carried as it is),
    so the wait for the loop counts against it; a blocking call waits at most
    :data:`~pegaflow.deadline.HOP_MARGIN_S` past it.  :meth:`node_session` gives the
    same for one node's ops.
    """

    def __init__(self, cfg: ClientConfig, token: str | None = None) -> None:
        # uvloop: a call from another thread reaches the loop and comes back faster than
        # on asyncio's own loop (52 / 264 us p50 / p90 against 84 / 774 us, one-off probe;
        # docs/benchmarks.md, "Same-host control")
        super().__init__(cfg, uvloop.new_event_loop())
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pegaflow-client", daemon=True
        )
        self._thread.start()
        self._client: PegaClient = self._wait(
            self._submit(self._make(cfg, token)), Deadline.of(cfg.rpc_timeout_s)
        )
        self._node_sessions: dict[str, SyncNodeSession] = {}
        self._sessions_lock = threading.Lock()
        self._token = token
        self._lookup_here = _Here(token)
        self._lookup_failed = False
        """the last :meth:`lookup_here` passed its deadline: the next goes through the loop"""

    @staticmethod
    async def _make(cfg: ClientConfig, token: str | None) -> PegaClient:
        return PegaClient(cfg, token)

    def _on_loop(self, fn: Callable[[PegaClient], Coroutine[Any, Any, T]], timeout: float) -> T:
        """``fn(async_client)`` on the loop, waited for: only for tests that reach into
        the async client's internals (callers use the operations)."""
        return self._wait(self._submit(fn(self._client)), Deadline.of(timeout))

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
        deadline = Deadline.of(timeout, self.cfg.lookup_timeout_s)
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
        if res is _LOOP:
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


class SyncNodeSession(OnLoop):
    """A blocking facade over a :class:`~.session.NodeSession` of a
    :class:`SyncPegaClient`: each of its operations as ``op(...)`` and
    ``submit_op(...)``, as on the client."""

    def __init__(self, client: SyncPegaClient, session: NodeSession) -> None:
        super().__init__(client.cfg, client._loop)
        self._session = session
        self.node_id = session.node_id
        self._here = _Here(client._token)

    @property
    def over_socket(self) -> bool:
        """See :attr:`NodeSession.over_socket`."""
        return self._session.over_socket

    def locate_here(
        self, ns: str, hashes: Sequence[bytes], shard: int = 0, ttl_s: float = 5.0,
        timeout: Timeout = None,
    ) -> tuple[int, LocatedBlocks]:  # fmt: skip
        """:meth:`NodeSession.locate` asked from the calling thread: over a blocking
        socket of its own (:class:`~pegaflow.transport.rpc_client.BlockingRpcClient`) to the node's
        control socket when the session has one, so the caller waits for the GIL once
        rather than at each hop to and from the loop thread (vLLM's scheduler, on the
        path of a request's first token, while other threads of its process are busy);
        through the loop otherwise, and whenever the blocking socket fails."""
        deadline = Deadline.of(timeout, self.cfg.rpc_timeout_s)
        msg = proto.encode_locate(ns, hashes, shard, ttl_s)
        op = msg.pop("op")
        res = self._here.call(self._session.control_address(), op, msg, deadline)
        if res is _LOOP:  # the loop's session finds out what went wrong, and recovers
            return self.locate(ns, hashes, shard, ttl_s, deadline)
        return proto.locate_reply(res, len(hashes))

    def close_here(self) -> None:
        """Close the blocking socket of :meth:`locate_here` (a later call opens another)."""
        self._here.close()


_LOOP = object()
"""what :meth:`_Here.call` answers when the call is to go through the loop instead"""


class _Here:
    """The blocking connection behind a facade's ``*_here`` calls
    (:class:`~pegaflow.transport.rpc_client.BlockingRpcClient`), to the address the facade's
    loop-side client uses now (a new connection when that changes).  One thread at a
    time: a call made while another thread asks, to no address, or whose connection
    fails is answered :data:`_LOOP` (ask through the loop instead)."""

    def __init__(self, token: str | None) -> None:
        self.client: BlockingRpcClient | None = None
        self._token = token
        self._lock = threading.Lock()

    def call(self, address: str | None, op: str, args: dict[str, Any], deadline: Deadline) -> Any:
        """``op``'s result, or :data:`_LOOP`; raises the call's other errors."""
        if address is None or not self._lock.acquire(blocking=False):
            return _LOOP
        try:
            c = self.client
            if c is None or c.address != address:
                self.close()
                c = self.client = BlockingRpcClient(address, token=self._token)
            return c.call(op, args, deadline)
        except Unavailable:
            self.close()
            return _LOOP
        finally:
            self._lock.release()

    def close(self) -> None:
        """Close the connection (a later call opens another)."""
        c, self.client = self.client, None
        if c is not None:
            c.close()


offer(SyncPegaClient, PegaClient, "_client")
offer(SyncNodeSession, NodeSession, "_session")
