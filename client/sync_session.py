"""The blocking form of one node's session (:class:`SyncNodeSession`), and the blocking
connection its ``*_here`` calls (and the client's) use from the caller's thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import Unavailable
from pegaflow.protocol import node as proto
from pegaflow.protocol.codec import LocatedBlocks
from pegaflow.protocol.node import Dropped
from pegaflow.transport.rpc_blocking import BlockingRpcClient

from .calls import OnLoop, deadline_of
from .data import GetOptions, PutOutcome
from .landing import Fetched
from .samehost import PoolFile
from .session import NodeSession

if TYPE_CHECKING:
    from .sync import SyncPegaClient


class SyncNodeSession(OnLoop):
    """A blocking facade over a :class:`~.session.NodeSession` of a
    :class:`~.sync.SyncPegaClient`: each operation blocks for its answer (the ``submit_``
    ones return a future of it); see :class:`~.calls.OnLoop` for the deadlines."""

    def __init__(self, client: SyncPegaClient, session: NodeSession) -> None:
        super().__init__(client.cfg, client._loop)
        self._session = session
        self.node_id = session.node_id
        self._here = Here(client._token)

    @property
    def over_socket(self) -> bool:
        """See :attr:`NodeSession.over_socket`."""
        return self._session.over_socket

    def forget_pool(self, timeout: Timeout = None) -> None:
        """Blocking :meth:`NodeSession.forget_pool`."""
        return self._call(self._session.forget_pool, timeout)

    def get(
        self,
        ns: str,
        items: Sequence[tuple[bytes, int, Any]],
        timeout: Timeout = None,
        gens: Sequence[int | None] | None = None,
        *,
        zero_copy: bool = False,
    ) -> list[bool]:
        """Blocking :meth:`NodeSession.get`: the blocks are copied into ``items``'
        buffers on this thread, and never once the call gave up."""
        s = self._session
        opts = GetOptions(gens, zero_copy)
        got: Fetched = self._wait(*self._start(s.get, timeout, ns, items, opts, via=s.fetch))
        return got.deliver()

    def put(
        self, ns: str, items: Sequence[tuple[bytes, int, Any]], timeout: Timeout = None
    ) -> PutOutcome:
        """Blocking :meth:`NodeSession.put`."""
        return self._call(self._session.put, timeout, ns, items)

    def pin(
        self,
        ns: str,
        blocks: Sequence[tuple[bytes, int]],
        ttl_s: float = 5.0,
        timeout: Timeout = None,
    ) -> list[bool]:
        """Blocking :meth:`NodeSession.pin`."""
        return self._call(self._session.pin, timeout, ns, blocks, ttl_s)

    def check(
        self, ns: str, blocks: Sequence[tuple[bytes, int, int | None]], timeout: Timeout = None
    ) -> list[bool]:
        """Blocking :meth:`NodeSession.check`."""
        return self._call(self._session.check, timeout, ns, blocks)

    def drop(self, ns: str, timeout: Timeout = None) -> Dropped:
        """Blocking :meth:`NodeSession.drop`."""
        return self._call(self._session.drop, timeout, ns)

    def pool_file(self, timeout: Timeout = None) -> PoolFile | None:
        """Blocking :meth:`NodeSession.pool_file`."""
        return self._call(self._session.pool_file, timeout)

    def locate(
        self,
        ns: str,
        hashes: Sequence[bytes],
        shard: int = 0,
        ttl_s: float = 5.0,
        timeout: Timeout = None,
    ) -> tuple[int, LocatedBlocks]:
        """Blocking :meth:`NodeSession.locate` (through the loop; see :meth:`locate_here`)."""
        return self._call(self._session.locate, timeout, ns, hashes, shard, ttl_s)

    def unpin(self, pin: int, timeout: Timeout = None) -> None:
        """Blocking :meth:`NodeSession.unpin`."""
        return self._call(self._session.unpin, timeout, pin)

    def submit_unpin(self, pin: int, timeout: Timeout = None) -> Future[None]:
        """:meth:`NodeSession.unpin` without waiting: a future of its answer."""
        return self._later(self._session.unpin, timeout, pin)

    def report_lookups(
        self, lookups: int, asked_blocks: int, hit_blocks: int, timeout: Timeout = None
    ) -> None:
        """Blocking :meth:`NodeSession.report_lookups`."""
        return self._call(
            self._session.report_lookups, timeout, lookups, asked_blocks, hit_blocks
        )

    def reserve_local(
        self,
        ns: str,
        blocks: Sequence[tuple[bytes, int, int]],
        pool: tuple[int, int],
        timeout: Timeout = None,
    ) -> tuple[int, list[int | None]]:
        """Blocking :meth:`NodeSession.reserve_local`."""
        return self._call(self._session.reserve_local, timeout, ns, blocks, pool)

    def commit_local(
        self,
        seq: int,
        accepted: Sequence[bool],
        timeout: Timeout = None,
        digests: Sequence[int | None] | None = None,
        on_taken: Callable[[], None] | None = None,
    ) -> PutOutcome:
        """Blocking :meth:`NodeSession.commit_local` (``on_taken`` runs on the loop)."""
        return self._call(
            self._session.commit_local, timeout, seq, accepted, digests=digests, on_taken=on_taken
        )

    def submit_commit_local(
        self,
        seq: int,
        accepted: Sequence[bool],
        timeout: Timeout = None,
        digests: Sequence[int | None] | None = None,
        on_taken: Callable[[], None] | None = None,
    ) -> Future[PutOutcome]:
        """:meth:`NodeSession.commit_local` without waiting: a future of its answer."""
        return self._later(
            self._session.commit_local, timeout, seq, accepted, digests=digests, on_taken=on_taken
        )

    def abort_local(self, seq: int, timeout: Timeout = None) -> None:
        """Blocking :meth:`NodeSession.abort_local`."""
        return self._call(self._session.abort_local, timeout, seq)

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


LOOP = object()
"""what :meth:`Here.call` answers when the call is to go through the loop instead"""


class Here:
    """The blocking connection behind a facade's ``*_here`` calls
    (:class:`~pegaflow.transport.rpc_blocking.BlockingRpcClient`), to the address the
    facade's loop-side client uses now (a new connection when that changes).  One thread
    at a time: a call made while another thread asks, to no address, or whose
    connection fails is answered :data:`LOOP` (ask through the loop instead)."""

    def __init__(self, token: str | None) -> None:
        self.client: BlockingRpcClient | None = None
        self._token = token
        self._lock = threading.Lock()

    def call(self, address: str | None, op: str, args: dict[str, Any], deadline: Deadline) -> Any:
        """``op``'s result, or :data:`LOOP`; raises the call's other errors."""
        if address is None or not self._lock.acquire(blocking=False):
            return LOOP
        try:
            c = self.client
            if c is None or c.address != address:
                self.close()
                c = self.client = BlockingRpcClient(address, token=self._token)
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
