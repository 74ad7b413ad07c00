"""The blocking form of one node's session (:class:`SyncNodeSession`), and the blocking
connection its ``*_here`` calls (and the client's) use from the caller's thread."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import Unavailable
from pegaflow.protocol import node as proto
from pegaflow.protocol.codec import LocatedBlocks
from pegaflow.transport.rpc_blocking import BlockingRpcClient

from .calls import OnLoop, blocking, blocking_get, deadline_of, submitted
from .session import NodeSession

if TYPE_CHECKING:
    from .sync import SyncPegaClient


class SyncNodeSession(OnLoop):
    """A blocking facade over a :class:`~.session.NodeSession` of a
    :class:`~.sync.SyncPegaClient`: each operation blocks for its answer (the ``submit_``
    ones return a future of it); see :class:`~.calls.OnLoop` for the deadlines."""

    def __init__(self, client: SyncPegaClient, session: NodeSession) -> None:
        super().__init__(client.cfg, client._loop)
        self._session = self._target = session
        self.node_id = session.node_id
        self._here = Here(client._token)

    # the data: its blocks
    get = blocking_get(NodeSession.get, NodeSession.fetch)
    put = blocking(NodeSession.put)
    pin = blocking(NodeSession.pin)
    check = blocking(NodeSession.check)
    drop = blocking(NodeSession.drop)

    @property
    def over_socket(self) -> bool:
        """See :attr:`NodeSession.over_socket`."""
        return self._session.over_socket

    # its pool file, read on this host
    forget_pool = blocking(NodeSession.forget_pool)
    pool_file = blocking(NodeSession.pool_file)
    locate = blocking(NodeSession.locate)  # through the loop; see locate_here
    unpin = blocking(NodeSession.unpin)
    submit_unpin = submitted(NodeSession.unpin)

    def locate_here(
        self, ns: str, hashes: Sequence[bytes], shard: int = 0, ttl_s: float = 5.0,
        timeout: Timeout = None,
    ) -> tuple[int, LocatedBlocks]:  # fmt: skip
        """:meth:`NodeSession.locate` asked from the calling thread: over a blocking
        socket of its own (:class:`~pegaflow.transport.rpc_blocking.BlockingRpcClient`)
        to the node's control socket when the session has one, so the caller waits for
        the GIL once rather than at each hop to and from the loop thread (vLLM's
        scheduler, on the path of a request's first token, while other threads of its
        process are busy); through the loop otherwise, and whenever the blocking socket
        fails."""
        deadline = deadline_of(self.cfg, self._session.locate, timeout)
        msg = proto.encode_locate(ns, hashes, shard, ttl_s)
        op = msg.pop("op")
        res = self._here.call(self._session.control_address(), op, msg, deadline)
        if res is LOOP:  # the loop's session finds out what went wrong, and recovers
            return self.locate(ns, hashes, shard, ttl_s, deadline)
        return proto.locate_reply(res, len(hashes))

    def close_here(self) -> None:
        """Close the blocking socket of :meth:`locate_here` (a later call opens another)."""
        self._here.close()

    # saves straight into its pool file from this host, and the lookup report
    report_lookups = blocking(NodeSession.report_lookups)
    reserve_local = blocking(NodeSession.reserve_local)
    commit_local = blocking(NodeSession.commit_local)  # on_taken runs on the loop
    submit_commit_local = submitted(NodeSession.commit_local)
    abort_local = blocking(NodeSession.abort_local)


LOOP = object()
"""what :meth:`Here.call` answers when the call is to go through the loop instead"""


class Here:
    """The blocking connection behind a facade's ``*_here`` calls
    (:class:`~pegaflow.transport.rpc_blocking.BlockingRpcClient`), to the address the
    facade's loop-side client uses now (a new connection when that changes).  One thread
    at a time: a call made while another thread asks, to no address, or whose
    connection fails is answered :data:`LOOP` (ask through the loop instead)."""

    def __init__(self, token: str | None, tls: ssl.SSLContext | None = None) -> None:
        self.client: BlockingRpcClient | None = None
        self._token = token
        self._tls = tls
        self._lock = threading.Lock()

    def call(self, address: str | None, op: str, args: dict[str, Any], deadline: Deadline) -> Any:
        """``op``'s result, or :data:`LOOP`; raises the call's other errors."""
        if address is None or not self._lock.acquire(blocking=False):
            return LOOP
        try:
            c = self.client
            if c is None or c.address != address:
                self.close()
                c = self.client = BlockingRpcClient(address, token=self._token, tls=self._tls)
            return c.call(op, args, deadline)
        except Unavailable:
            self.close()
            return LOOP
        finally:
            self._lock.release()

    def close(self) -> None:
        """Close the connection (a later call opens another)."""
        c, self.client = self.client, None
        if c is not None:
            c.close()
