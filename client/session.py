"""A node session: one storage node's ops, for one client.

A :class:`NodeSession` speaks to one node.  Its bulk ops (``get``, ``put``) and the ops
only UCX serves (``pin``, ``check``, ``drop``) go over the client's UCX connection to
the node (:class:`~pegaflow.client.data.DataClient`).  Its same-host ops (``locate``,
``unpin``, ``report``, and a save through the pool file: ``reserve`` local, ``commit``,
``abort``) go straight over the node's Unix control socket
(:mod:`pegaflow.storage_node.local_control`) when the client is on the node's host: the
socket's path comes with the node's pool file (:class:`~.data.PoolFile`), either given
when the session is made (the connector's search for its node found it: no UCX hello
then) or learned from the UCX hello.  A session that cannot use the socket (another
host, another user, the socket went away) asks those ops over UCX instead, until a new
UCX hello offers the socket again; a reservation made on one transport is committed or
aborted on it (the node drops it with the transport's session otherwise).

A session made for a node id checks, on every UCX request, that the node answering at
the address is that node (the id its hello names): when another node answers there
(two nodes publish one address), its ops raise :class:`~pegaflow.errors.WrongPeer`
and its gets give misses, rather than reaching that other node (see
:mod:`pegaflow.client.data`).  A session made with :meth:`NodeSession.at` without a
node id takes whichever node answers.

Requests and replies are built and read by the codecs of the node's protocol
(:mod:`pegaflow.protocol.node`): adding an op is its entry there, its handler in
the node's service, and its method here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any

from pegaflow.config import ClientConfig
from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import PegaError, Unavailable
from pegaflow.protocol import node as proto
from pegaflow.protocol.codec import LocatedBlocks
from pegaflow.protocol.framing import UNIX_PREFIX
from pegaflow.transport.rpc_client import RpcClient

from .calls import deadline_of, operation
from .data import DataClient, GetOptions, PutOutcome, retrieve
from .landing import Fetched
from .samehost import PoolFile

log = logging.getLogger(__name__)

Address = Callable[[Deadline], Awaitable[str]]
"""The node's UCX address (from its record, which may change while the session lives)."""

Refresh = Callable[[Deadline], Awaitable[object]]
"""Learn the node's record anew (it was restarted, perhaps at another address)."""


@dataclass(eq=False, repr=False)
class NodeSession:
    """One node's ops (see the module docstring).

    Args:
        node_id: the node's id ('' when only its address is known): every UCX request
            checks that this node answers at the address (:class:`~pegaflow.errors.WrongPeer`
            otherwise); '' takes whichever node answers.
        data: the client's UCX transport.
        address: the node's UCX address, looked up for each UCX request.
        token: the cluster token, for the control socket.
        local_control: use the control socket when the node offers one.
        pool: the node's pool file, when known already (its ``control`` is the socket).
        cfg: the client configuration the ops' default timeouts come from (None: every
            call passes its timeout).
        refresh: learn the node's record anew (:meth:`forget_pool`).
    """

    node_id: str
    data: InitVar[DataClient]
    address: InitVar[Address]
    _: KW_ONLY
    token: InitVar[str | None] = None
    local_control: InitVar[bool] = True
    pool: InitVar[PoolFile | None] = None
    cfg: InitVar[ClientConfig | None] = None
    refresh: InitVar[Refresh | None] = None
    _socket: RpcClient | None = field(default=None, init=False)
    _socket_of: PoolFile | None = field(default=None, init=False)
    """the pool file whose socket :attr:`_socket` is"""
    _refused: PoolFile | None = field(default=None, init=False)
    """the pool file whose socket failed: its socket is not tried again"""

    def __post_init__(
        self,
        data: DataClient,
        address: Address,
        token: str | None,
        local_control: bool,
        pool: PoolFile | None,
        cfg: ClientConfig | None,
        refresh: Refresh | None,
    ) -> None:
        self._given = pool
        """the pool file learned elsewhere (else the UCX hello's counts)"""
        self._data, self._address, self._refresh = data, address, refresh
        self._token, self._local_control, self._cfg = token, local_control, cfg

    @classmethod
    def at(cls, addr: str, data: DataClient, **kwargs: Any) -> NodeSession:
        """A session with the node at UCX address ``addr`` (a fixed address)."""

        async def fixed(_deadline: Deadline) -> str:
            return addr

        return cls(kwargs.pop("node_id", ""), data, fixed, **kwargs)

    def know(self, pool: PoolFile) -> None:
        """The node's pool file, learned elsewhere (its socket is tried next)."""
        if pool is not self._refused:
            self._given = pool

    @operation("rpc_timeout_s")
    async def forget_pool(self, timeout: Timeout = None) -> None:
        """Forget what this session knows of the node's pool file (the node answered
        :class:`~pegaflow.errors.PoolChanged`: it was restarted on a new file): the next
        :meth:`pool_file` comes from a new UCX hello, at the address of the node's record
        learned anew, and the control socket is opened again."""
        self._given = self._refused = None
        self.close()
        deadline = self._deadline("forget_pool", timeout)
        with contextlib.suppress(PegaError):
            if self._refresh is not None:
                await self._refresh(deadline)
            self._data.reconnect(await self._address(deadline))

    @property
    def over_socket(self) -> bool:
        """Whether the same-host ops go over the control socket now."""
        return self._socket is not None

    def control_address(self) -> str | None:
        """The address of the control socket this session uses, or would use first
        (None when it has none), for a caller that asks from its own thread (see
        :meth:`~.sync_session.SyncNodeSession.locate_here`)."""
        sock, pool = self._socket, self._given
        if sock is not None:
            return sock.current_address
        if self._local_control and pool and pool.control and pool is not self._refused:
            return UNIX_PREFIX + pool.control  # given: this session has not used it yet
        return None

    def close(self) -> None:
        """Close the control socket (the UCX connection is the client's)."""
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.close_now()

    def _deadline(self, op: str, timeout: Timeout) -> Deadline:
        """The deadline of operation ``op`` (:func:`~.calls.deadline_of`)."""
        return deadline_of(self._cfg, getattr(NodeSession, op), timeout)

    # ---- transports ----------------------------------------------------------------

    async def _ucx(self, msg: dict[str, Any], deadline: Deadline) -> dict[str, Any]:
        addr = await self._address(deadline)
        return await self._data.call(addr, msg, deadline, expect_node=self.node_id)

    async def _pool(self, deadline: Deadline) -> PoolFile | None:
        """The pool file given (until its socket fails), else the UCX hello's."""
        if self._given is not None:
            return self._given
        addr = await self._address(deadline)
        return await self._data.pool_file(addr, deadline, expect_node=self.node_id)

    async def _control(self, deadline: Deadline) -> RpcClient | None:
        """The control socket, if this session can use one (opened on first use)."""
        if self._socket is not None or not self._local_control:
            return self._socket
        pool = await self._pool(deadline)
        if pool is None or pool.control is None or pool is self._refused:
            return None
        self._socket_of = pool
        self._socket = RpcClient(
            [UNIX_PREFIX + pool.control],
            token=self._token,
            connect_timeout=self._data.connect_timeout,
        )
        return self._socket

    async def _same_host(self, msg: dict[str, Any], deadline: Deadline) -> dict[str, Any]:
        """A same-host op: over the control socket when this session can use it, else
        over UCX."""
        sock = await self._control(deadline)
        if sock is not None:
            args = {k: v for k, v in msg.items() if k != "op"}
            try:
                return await sock.call(msg["op"], args, deadline)
            except Unavailable as e:  # not this host after all, or the socket went away
                if self._socket is sock:
                    self._socket, self._refused = None, self._socket_of
                    if self._given is self._refused:
                        self._given = None  # the hello's pool file counts from now on
                    sock.close_now()
                    log.info(
                        "node %s: control socket unusable (%s); asking over UCX",
                        self.node_id or "?", e,
                    )  # fmt: skip
        return await self._ucx(msg, deadline)

    # ---- over UCX ------------------------------------------------------------------

    @operation("transfer_timeout_s")
    async def get(
        self,
        ns: str,
        items: Sequence[tuple[bytes, int, Any]],
        timeout: Timeout = None,
        gens: Sequence[int | None] | None = None,
        *,
        zero_copy: bool = False,
    ) -> list[bool]:
        """Fetch ``(hash, shard, buffer)`` blocks; once it returned, nothing writes the
        buffers, unless ``zero_copy`` (see :meth:`DataClient.get`)."""
        return (await self.fetch(ns, items, GetOptions(gens, zero_copy), timeout)).deliver()

    async def fetch(
        self, ns: str, items: Sequence[tuple[bytes, int, Any]], opts: GetOptions,
        timeout: Timeout = None,
    ) -> Fetched:  # fmt: skip
        """:meth:`get` but its last step (:meth:`DataClient.fetch`)."""
        deadline = self._deadline("get", timeout)
        addr = await self._address(deadline)
        return await self._data.fetch(addr, ns, items, deadline, opts, self.node_id)

    @operation("transfer_timeout_s")
    async def put(
        self, ns: str, items: Sequence[tuple[bytes, int, Any]], timeout: Timeout = None
    ) -> PutOutcome:
        """Store ``(hash, shard, buffer)`` blocks (see :meth:`DataClient.put`)."""
        deadline = self._deadline("put", timeout)
        addr = await self._address(deadline)
        return await self._data.put(addr, ns, items, deadline, expect_node=self.node_id)

    @operation("rpc_timeout_s")
    async def pin(
        self,
        ns: str,
        blocks: Sequence[tuple[bytes, int]],
        ttl_s: float = 5.0,
        timeout: Timeout = None,
    ) -> list[bool]:
        """Keep ``(hash, shard)`` blocks from eviction for ``ttl_s`` (a read pin between
        lookup and get); per block, whether it is stored and now pinned."""
        if not blocks:
            return []
        deadline = self._deadline("pin", timeout)
        return proto.pin_reply(await self._ucx(proto.encode_pin(ns, blocks, ttl_s), deadline))

    @operation("rpc_timeout_s")
    async def check(
        self, ns: str, blocks: Sequence[tuple[bytes, int, int | None]], timeout: Timeout = None
    ) -> list[bool]:
        """Per ``(hash, shard, generation or None)``: whether the node holds that block
        committed (with that generation).  Raises a typed error when the node cannot
        answer (never guess: the index GC deletes what this says is gone)."""
        if not blocks:
            return []
        deadline = self._deadline("check", timeout)
        reply = await self._ucx(proto.encode_check(ns, blocks), deadline)
        return proto.check_reply(reply, len(blocks), self.node_id or "the node")

    @operation("rpc_timeout_s")
    async def drop(self, ns: str, timeout: Timeout = None) -> proto.Dropped:
        """Drop every block of namespace ``ns`` from the node (an operator's op: it needs
        the cluster token): they are unpublished and their slots freed, pinned ones once
        their pins go."""
        deadline = self._deadline("drop", timeout)
        return proto.drop_reply(await self._ucx(proto.encode_drop(ns), deadline))

    # ---- same host -----------------------------------------------------------------

    @operation("rpc_timeout_s")
    async def pool_file(self, timeout: Timeout = None) -> PoolFile | None:
        """The node's pool file, if it offers it to this client (whether this process
        can open it is for the caller to check): the one given, else the UCX hello's."""
        return await self._pool(self._deadline("pool_file", timeout))

    @operation("rpc_timeout_s")
    async def locate(
        self,
        ns: str,
        hashes: Sequence[bytes],
        shard: int = 0,
        ttl_s: float = 5.0,
        timeout: Timeout = None,
    ) -> tuple[int, LocatedBlocks]:
        """Pin blocks ``(h, shard)`` for ``ttl_s`` and return (pin id, where each one is
        in the pool file).  The hashes must all have the same length.

        The caller copies the bytes out of its own mapping of the file, checks each
        block's digest or xxh3 and then releases the pin with :meth:`unpin`.
        """
        deadline = self._deadline("locate", timeout)
        msg = proto.encode_locate(ns, hashes, shard, ttl_s)
        return proto.locate_reply(await self._same_host(msg, deadline), len(hashes))

    @operation("rpc_timeout_s")
    async def unpin(self, pin: int, timeout: Timeout = None) -> None:
        """Release a pin taken by :meth:`locate` or :meth:`pin` (idempotent)."""
        deadline = self._deadline("unpin", timeout)
        await self._same_host(proto.encode_unpin(pin), deadline)

    @operation("rpc_timeout_s")
    async def report_lookups(
        self, lookups: int, asked_blocks: int, hit_blocks: int, timeout: Timeout = None
    ) -> None:
        """Report lookups this client answered from this node alone (never asked of a
        coordinator), for the cluster-wide hit rate."""
        msg = proto.encode_report(lookups, asked_blocks, hit_blocks)
        await self._same_host(msg, self._deadline("report_lookups", timeout))

    @operation("transfer_timeout_s")
    async def reserve_local(
        self,
        ns: str,
        blocks: Sequence[tuple[bytes, int, int]],
        pool: tuple[int, int],
        timeout: Timeout = None,
    ) -> tuple[int, list[int | None]]:
        """Reserve slots for ``(hash, shard, size)`` blocks that the caller writes through
        its mapping of the pool file ``pool`` (:attr:`PoolFile.file_id` of the file it
        mapped); returns (reservation, slot offset or None when already stored).  Finish
        with :meth:`commit_local` (or :meth:`abort_local`).  Raises
        :class:`~pegaflow.errors.PoolChanged` when the node's pool is another file now:
        map it again (:meth:`forget_pool`, :meth:`pool_file`)."""
        deadline = self._deadline("reserve_local", timeout)
        msg = proto.encode_reserve_local(ns, blocks, pool)
        reply = await self._same_host(msg, deadline)
        return proto.reserve_local_reply(msg, reply, len(blocks))

    @operation("transfer_timeout_s")
    async def commit_local(
        self,
        seq: int,
        accepted: Sequence[bool],
        timeout: Timeout = None,
        digests: Sequence[int | None] | None = None,
        on_taken: Callable[[], None] | None = None,
    ) -> PutOutcome:
        """Commit a local reservation (``accepted``: which blocks it reserved): the node
        hashes each written slot, keeps that xxh3 as the block's checksum and publishes
        it; ``digests``: the writer's device digests, kept with the blocks.

        ``on_taken`` is called (once, on the client's loop) as soon as the node holds
        the commit, which it then carries out whatever happens to this process: a
        ``taken`` request sent right behind the commit says so within a round trip,
        while the node still hashes.  Else (an older node, an error) it is called when
        the commit's answer came, whatever it was."""
        msg = proto.encode_commit(seq, [None] * len(accepted), digests)
        # the commit and its taken share one deadline
        deadline = self._deadline("commit_local", timeout)
        if on_taken is None:
            reply = await self._same_host(msg, deadline)
        else:
            # the transport is settled first, so both requests are queued in this order
            # on one connection before either is written; the node takes the commit as
            # it reads its frame
            await self._control(deadline)
            commit = asyncio.ensure_future(self._same_host(msg, deadline))
            commit.add_done_callback(retrieve)  # awaited below, unless cancelled first
            ask = asyncio.ensure_future(self._same_host(proto.encode_taken(seq), deadline))
            try:
                held = proto.taken_reply(await ask)
            except PegaError:
                held = False
            if held:
                on_taken()
            try:
                reply = await commit
            finally:
                if not held:
                    on_taken()
        n_accepted = sum(1 for a in accepted if a)
        stored = proto.commit_reply(reply)
        return PutOutcome(
            stored=stored, skipped=len(accepted) - n_accepted, failed=n_accepted - stored
        )

    @operation("rpc_timeout_s")
    async def abort_local(self, seq: int, timeout: Timeout = None) -> None:
        """Drop a local reservation (its slots go back to the pool)."""
        deadline = self._deadline("abort_local", timeout)
        await self._same_host(proto.encode_abort(seq), deadline)
