"""etcd v3 access: one client with deadlines, failover, TLS, auth, paging, leases, watches.

Deadlines on every call (:class:`~pegaflow.deadline.Deadline`), endpoint failover, TLS
and user auth, paged range reads, batched transactions, leases (one kept alive:
:class:`~pegaflow.etcd_lease.KeptLease`) and watches.

:class:`EtcdClient` speaks to etcd through the generated gRPC stubs that ship with
``aetcd`` (``aetcd.rpc``) instead of ``aetcd.Client``'s high-level API, because that API
has no TLS, no paging (``limit``/``revision`` of a range), no watch progress requests and
no fragmented watch responses, all of which the index needs at a million keys.

Every call takes the remaining part of one deadline (``[etcd] timeout_s`` unless given);
a failed call raises a :class:`~pegaflow.errors.PegaError`: ``Unavailable`` (no endpoint
answers), ``DeadlineExceeded``, ``NotFound`` (e.g. an expired lease), ``Unauthorized``,
``BadRequest`` (e.g. more ops than etcd's ``--max-txn-ops``), ``NoSpace`` (etcd's
backend quota) or :class:`RevisionCompacted`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, TypeVar

import grpc
from aetcd import rpc

from pegaflow.auth import secret
from pegaflow.config import EtcdConfig
from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import (
    BadRequest,
    DeadlineExceeded,
    Internal,
    NoSpace,
    NotFound,
    PegaError,
    Unauthorized,
    Unavailable,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Largest gRPC message sent or received (a range page, a fragmented watch response).
MAX_MESSAGE_BYTES = 64 << 20
#: Keys per page of a range read.
DEFAULT_PAGE_SIZE = 5000

PUT = rpc.Event.EventType.PUT
DELETE = rpc.Event.EventType.DELETE

_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Detect a dead etcd on a quiet watch stream; etcd refuses pings more often than 5 s.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's default reconnect backoff grows to 120 s; come back quickly after an outage.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


class RevisionCompacted(PegaError):
    """The revision asked for was compacted away; the reader must resync from scratch."""

    code = "compacted"

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"etcd revision compacted (oldest kept: {compact_revision})")
        self.compact_revision = compact_revision


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


def put_op(key: bytes, value: bytes, lease: int = 0) -> rpc.RequestOp:
    """A put for :meth:`EtcdClient.txn`."""
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def delete_op(key: bytes) -> rpc.RequestOp:
    """An unconditional delete for :meth:`EtcdClient.txn`."""
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def delete_if_lease_op(key: bytes, lease: int) -> rpc.RequestOp:
    """A delete that happens only while ``key`` is still attached to ``lease`` (a nested
    txn), so a node never deletes an entry that another node has overwritten since."""
    cmp = rpc.Compare(
        key=key, target=rpc.Compare.CompareTarget.LEASE, result=rpc.Compare.EQUAL, lease=lease
    )
    return rpc.RequestOp(request_txn=rpc.TxnRequest(compare=[cmp], success=[delete_op(key)]))


def delete_if_unmodified_op(key: bytes, mod_revision: int) -> rpc.RequestOp:
    """A delete that happens only while ``key`` was not written since ``mod_revision``
    (a nested txn): the index GC never deletes an entry a node has rewritten since."""
    cmp = rpc.Compare(
        key=key, target=rpc.Compare.CompareTarget.MOD, result=rpc.Compare.EQUAL,
        mod_revision=mod_revision,
    )  # fmt: skip
    return rpc.RequestOp(request_txn=rpc.TxnRequest(compare=[cmp], success=[delete_op(key)]))


def range_op(key: bytes) -> rpc.RequestOp:
    """A read of one key, for :meth:`EtcdClient.txn` (many keys in one round trip)."""
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))


def _translate(e: grpc.aio.AioRpcError, endpoint: str) -> PegaError:
    code = e.code()
    details = e.details() or ""
    if any(m in details for m in _AUTH_ERRORS):  # etcd reports most as INVALID_ARGUMENT
        return Unauthorized(f"etcd at {endpoint}: {details}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"etcd at {endpoint} unreachable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"etcd at {endpoint} did not answer in time")
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(f"etcd: {details}")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return Unauthorized(f"etcd: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return BadRequest(f"etcd: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return NoSpace(f"etcd: {details}")
    if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
        return RevisionCompacted(0)
    if code == grpc.StatusCode.CANCELLED:
        return Unavailable(f"etcd call to {endpoint} cancelled: {details}")
    return Internal(f"etcd {code.name}: {details}")


_AUTH_ERRORS = (
    "authentication failed",
    "user name is empty",
    "invalid auth token",
    "permission denied",
    "user name not found",
)


def _is_token_expired(e: grpc.aio.AioRpcError) -> bool:
    return "invalid auth token" in (e.details() or "")


def _strip_scheme(endpoint: str) -> tuple[str, bool]:
    for scheme, tls in (("https://", True), ("http://", False), ("unixs://", True)):
        if endpoint.startswith(scheme):
            return endpoint[len(scheme) :], tls
    return endpoint, False


@dataclass
class _Stubs:
    channel: grpc.aio.Channel
    endpoint: str
    kv: rpc.KVStub
    lease: rpc.LeaseStub
    watch: rpc.WatchStub
    maintenance: rpc.MaintenanceStub


class EtcdClient:
    """One process's connection to an etcd cluster (see the module docstring).

    Endpoints are tried in order; a call that finds its endpoint unreachable moves to the
    next one within the same deadline.  Safe to share between tasks of one event loop.
    """

    def __init__(self, cfg: EtcdConfig) -> None:
        if not cfg.endpoints:
            raise ValueError("EtcdClient needs at least one endpoint ([etcd] endpoints)")
        self.cfg = cfg
        self.timeout = float(cfg.timeout_s)
        self._endpoints = list(cfg.endpoints)
        self._current = 0
        self._stubs: _Stubs | None = None
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    @property
    def endpoint(self) -> str:
        """The endpoint calls go to now."""
        return self._endpoints[self._current]

    def _credentials(self) -> grpc.ChannelCredentials:
        def read(path: str) -> bytes | None:
            if not path:
                return None
            with open(path, "rb") as fh:
                return fh.read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.cfg.ca_cert),
            private_key=read(self.cfg.cert_key),
            certificate_chain=read(self.cfg.cert_cert),
        )

    async def _open(self, deadline: Deadline) -> _Stubs:
        endpoint = self._endpoints[self._current]
        target, tls = _strip_scheme(endpoint)
        if tls or self.cfg.ca_cert or self.cfg.cert_cert:
            channel = grpc.aio.secure_channel(target, self._credentials(), options=_CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        stubs = _Stubs(
            channel,
            endpoint,
            rpc.KVStub(channel),
            rpc.LeaseStub(channel),
            rpc.WatchStub(channel),
            rpc.MaintenanceStub(channel),
        )
        if self.cfg.username:
            password = secret(self.cfg.password, self.cfg.password_file, "[etcd] password") or ""
            try:
                resp = await rpc.AuthStub(channel).Authenticate(
                    rpc.AuthenticateRequest(name=self.cfg.username, password=password),
                    timeout=deadline.left(),
                )
            except grpc.aio.AioRpcError as e:
                await channel.close()
                raise _translate(e, endpoint) from None
            self._metadata = (("token", resp.token),)
        else:
            self._metadata = None
        return stubs

    async def _ensure(self, deadline: Deadline) -> _Stubs:
        if self._closed:
            raise Unavailable("etcd client closed")
        stubs = self._stubs
        if stubs is not None:
            return stubs
        async with self._lock:
            if self._stubs is None:
                self._stubs = await self._open(deadline)
            return self._stubs

    async def _reset(self, stubs: _Stubs, rotate: bool) -> None:
        """Drop a broken channel (and move to the next endpoint) unless already done."""
        async with self._lock:
            if self._stubs is not stubs:
                return
            self._stubs = None
            if rotate:
                self._current = (self._current + 1) % len(self._endpoints)
        with contextlib.suppress(Exception):
            await stubs.channel.close()

    async def call(
        self,
        method: Callable[[_Stubs], Any],
        request: Any,
        timeout: Timeout = None,
    ) -> Any:
        """Run one unary RPC (``method`` picks the stub method) within the deadline."""
        deadline = Deadline.of(timeout, self.timeout)
        reauthed = False
        tries = len(self._endpoints)
        last: PegaError | None = None
        while True:
            if deadline.expired:
                raise last or DeadlineExceeded("etcd call passed its deadline")
            stubs = await self._ensure(deadline)
            try:
                rpc_call = method(stubs)
                return await rpc_call(request, timeout=deadline.left(), metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                err = _translate(e, stubs.endpoint)
                if self.cfg.username and not reauthed and _is_token_expired(e):
                    reauthed = True
                    await self._reset(stubs, rotate=False)
                    continue
                if isinstance(err, Unavailable) and tries > 1:
                    tries -= 1
                    last = err
                    await self._reset(stubs, rotate=True)
                    continue
                raise err from None

    async def connect(self) -> None:
        """Open the channel and check that etcd answers (raises ``Unavailable`` if not)."""
        await self.status()

    async def close(self) -> None:
        """Close the channel; later calls raise ``Unavailable``."""
        self._closed = True
        stubs, self._stubs = self._stubs, None
        if stubs is not None:
            with contextlib.suppress(Exception):
                await stubs.channel.close()

    # -- KV ---------------------------------------------------------------------------

    async def status(self, timeout: Timeout = None) -> rpc.StatusResponse:
        """The answering member's status (version, db size, leader, raft index)."""
        return await self.call(lambda s: s.maintenance.Status, rpc.StatusRequest(), timeout)

    async def get(self, key: bytes, timeout: Timeout = None) -> rpc.KeyValue | None:
        """One key's KeyValue, or None."""
        r = await self.call(lambda s: s.kv.Range, rpc.RangeRequest(key=key), timeout)
        return r.kvs[0] if r.kvs else None

    async def put(
        self, key: bytes, value: bytes, lease: int = 0, timeout: Timeout = None
    ) -> int:
        """Put one key; returns the revision of the write."""
        r = await self.call(
            lambda s: s.kv.Put, rpc.PutRequest(key=key, value=value, lease=lease), timeout
        )
        return r.header.revision

    async def count_prefix(self, prefix: bytes, timeout: Timeout = None) -> tuple[int, int]:
        """``(number of keys under prefix, current revision)``."""
        req = rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix), count_only=True)
        r = await self.call(lambda s: s.kv.Range, req, timeout)
        return r.count, r.header.revision

    async def range_pages(
        self,
        prefix: bytes,
        *,
        revision: int = 0,
        page_size: int = DEFAULT_PAGE_SIZE,
        keys_only: bool = False,
        end: bytes | None = None,
        timeout: Timeout = None,
    ) -> AsyncIterator[tuple[int, Sequence[rpc.KeyValue]]]:
        """Yield ``(revision, kvs)`` pages of every key under ``prefix`` (or, with
        ``end``, of ``[prefix, end)``), in key order, all read at one revision (the
        current one unless ``revision`` is given).  Each page is one call with its own
        deadline.  Raises :class:`RevisionCompacted` when the revision is compacted
        away meanwhile.

        etcd 3.4 walks the whole rest of the range for every page (to count it), so a
        huge range costs O(n^2 / page_size): split huge ranges (see :meth:`probe`)."""
        end = prefix_range_end(prefix) if end is None else end

        def fetch(key: bytes, rev: int) -> asyncio.Task[Any]:
            req = rpc.RangeRequest(
                key=key, range_end=end, limit=page_size, revision=rev, keys_only=keys_only
            )
            return asyncio.ensure_future(self.call(lambda s: s.kv.Range, req, timeout))

        task = fetch(prefix, revision)
        try:
            while True:
                r = await task
                revision = r.header.revision if revision == 0 else revision
                if r.more and r.kvs:  # fetch the next page while this one is consumed
                    task = fetch(r.kvs[-1].key + b"\0", revision)
                yield revision, r.kvs
                if not r.more or not r.kvs:
                    return
        finally:
            if not task.done():
                task.cancel()

    async def probe(
        self, start: bytes, end: bytes, *, revision: int = 0, timeout: Timeout = None
    ) -> tuple[int, bytes | None, int]:
        """``(keys in [start, end), first key or None, revision)`` in one call."""
        req = rpc.RangeRequest(key=start, range_end=end, limit=1, keys_only=True, revision=revision)
        r = await self.call(lambda s: s.kv.Range, req, timeout)
        return r.count, (r.kvs[0].key if r.kvs else None), r.header.revision

    async def txn(
        self,
        success: Sequence[rpc.RequestOp],
        compare: Sequence[rpc.Compare] = (),
        failure: Sequence[rpc.RequestOp] = (),
        timeout: Timeout = None,
    ) -> rpc.TxnResponse:
        """One transaction (at most ``--max-txn-ops`` ops per branch)."""
        req = rpc.TxnRequest(compare=compare, success=success, failure=failure)
        return await self.call(lambda s: s.kv.Txn, req, timeout)

    async def put_if_absent(
        self, key: bytes, value: bytes, timeout: Timeout = None
    ) -> tuple[bytes, bool]:
        """Create ``key`` with ``value`` unless it exists, in one transaction; returns
        ``(the value stored now, whether this call created it)``, so concurrent callers
        all end up with the same value."""
        absent = rpc.Compare(
            key=key, target=rpc.Compare.CompareTarget.CREATE, result=rpc.Compare.EQUAL,
            create_revision=0,
        )  # fmt: skip
        r = await self.txn(
            [put_op(key, value)], compare=[absent], failure=[range_op(key)], timeout=timeout
        )
        if r.succeeded:
            return value, True
        return r.responses[0].response_range.kvs[0].value, False  # one txn: it exists

    async def write_batches(
        self,
        ops: Iterable[rpc.RequestOp],
        *,
        batch_size: int | None = None,
        concurrency: int = 4,
    ) -> int:
        """Run ``ops`` as transactions of ``batch_size`` ops (default ``[etcd]
        batch_size``), ``concurrency`` of them in flight; returns the number of ops."""
        size = batch_size or self.cfg.batch_size
        it = iter(ops)
        done = 0

        async def worker() -> None:
            nonlocal done
            while batch := list(islice(it, size)):
                await self.txn(batch)
                done += len(batch)

        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
        return done

    # -- leases -----------------------------------------------------------------------

    async def grant(self, ttl: int, timeout: Timeout = None) -> int:
        """Grant a lease of ``ttl`` seconds; returns its id."""
        r = await self.call(lambda s: s.lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl), timeout)
        if r.error:
            raise Internal(f"etcd refused a lease: {r.error}")
        return r.ID

    async def keepalive(self, lease_id: int, timeout: Timeout = None) -> int:
        """Refresh a lease once; returns its new TTL, 0 when it no longer exists."""
        req = rpc.LeaseKeepAliveRequest(ID=lease_id)

        def method(s: _Stubs) -> Callable[..., Any]:
            async def once(r: Any, *, timeout: float, metadata: Any) -> int:
                stream = s.lease.LeaseKeepAlive(iter([r]), timeout=timeout, metadata=metadata)
                try:
                    async for reply in stream:
                        return int(reply.TTL)
                    return 0
                finally:
                    stream.cancel()

            return once

        return await self.call(method, req, timeout)

    async def revoke(self, lease_id: int, timeout: Timeout = None) -> None:
        """Revoke a lease: every key attached to it is deleted now."""
        await self.call(lambda s: s.lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id), timeout)

    async def compact(self, revision: int, timeout: Timeout = None) -> None:
        """Compact history up to ``revision`` (tests and maintenance)."""
        await self.call(lambda s: s.kv.Compact, rpc.CompactionRequest(revision=revision), timeout)

    # -- watches ----------------------------------------------------------------------

    async def watch(
        self,
        prefix: bytes,
        start_revision: int,
        *,
        progress_notify: bool = True,
        timeout: Timeout = None,
    ) -> Watch:
        """Open a watch of every key under ``prefix`` from ``start_revision`` on.

        Returns once etcd confirmed the watch (within the deadline); raises
        :class:`RevisionCompacted` if ``start_revision`` is already compacted."""
        deadline = Deadline.of(timeout, self.timeout)
        stubs = await self._ensure(deadline)
        call = stubs.watch.Watch(metadata=self._metadata)
        create = rpc.WatchCreateRequest(
            key=prefix,
            range_end=prefix_range_end(prefix),
            start_revision=start_revision,
            progress_notify=progress_notify,
            fragment=True,
        )
        try:
            async with asyncio.timeout(deadline.left()):
                await call.write(rpc.WatchRequest(create_request=create))
                first = await call.read()
        except TimeoutError:
            call.cancel()
            raise DeadlineExceeded(f"etcd at {stubs.endpoint} did not confirm a watch") from None
        except grpc.aio.AioRpcError as e:
            call.cancel()
            err = _translate(e, stubs.endpoint)
            if isinstance(err, Unavailable):
                await self._reset(stubs, rotate=len(self._endpoints) > 1)
            raise err from None
        if first is grpc.aio.EOF:
            call.cancel()
            raise Unavailable(f"etcd at {stubs.endpoint} closed the watch stream")
        if first.compact_revision:
            call.cancel()
            raise RevisionCompacted(first.compact_revision)
        if not first.created or first.canceled:
            call.cancel()
            raise Unavailable(f"etcd refused the watch: {first.cancel_reason or first}")
        return Watch(call, stubs.endpoint, first)


class Watch:
    """An open watch stream: iterate :meth:`responses`, ask for progress, cancel."""

    def __init__(self, call: Any, endpoint: str, created: rpc.WatchResponse) -> None:
        self._call = call
        self.endpoint = endpoint
        #: etcd's revision when the watch was created.
        self.created_revision: int = created.header.revision
        #: etcd's cluster id (changes when etcd was rebuilt from scratch).
        self.cluster_id: int = created.header.cluster_id
        self._cancelled = False

    async def responses(self) -> AsyncIterator[rpc.WatchResponse]:
        """Every response (events, or none for a progress notification) until the stream
        ends; ends by raising ``Unavailable`` or :class:`RevisionCompacted`."""
        while True:
            try:
                r = await self._call.read()
            except grpc.aio.AioRpcError as e:
                raise _translate(e, self.endpoint) from None
            except asyncio.CancelledError:
                if self._cancelled:  # our own cancel(), not the reading task's
                    raise Unavailable("watch cancelled") from None
                raise
            if r is grpc.aio.EOF:
                raise Unavailable(f"etcd at {self.endpoint} ended the watch stream")
            if r.compact_revision:
                raise RevisionCompacted(r.compact_revision)
            if r.canceled:
                raise Unavailable(f"etcd cancelled the watch: {r.cancel_reason}")
            yield r

    async def request_progress(self) -> None:
        """Ask etcd for a progress notification (a response with no events whose header
        revision says how far the stream has delivered)."""
        try:
            await self._call.write(rpc.WatchRequest(progress_request=rpc.WatchProgressRequest()))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            raise Unavailable(f"etcd watch stream to {self.endpoint} broken: {e}") from None

    def cancel(self) -> None:
        """Close the stream."""
        self._cancelled = True
        self._call.cancel()


async def connect(cfg: EtcdConfig) -> EtcdClient:
    """An :class:`EtcdClient` for ``cfg`` that has checked etcd answers (``Unavailable``
    with the endpoints in the message when it does not)."""
    client = EtcdClient(cfg)
    try:
        await client.connect()
    except PegaError as e:
        await client.close()
        raise Unavailable(
            f"cannot reach etcd at {', '.join(cfg.endpoints)}: {e}. "
            "Check that etcd runs and --etcd-endpoints (PEGAFLOW_ETCD_ENDPOINTS) is right."
        ) from None
    return client
