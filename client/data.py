"""The client side of the node data plane (see :mod:`pegaflow.storage_node.data_server`).

One :class:`DataClient` per event loop holds a UCX worker and one endpoint per node,
reused across calls.  Payloads land directly in the caller's buffers; every block is
checked against the node's xxh3 before it counts as fetched.  A timeout or transport
error closes the endpoint (cancelling its receives, so no late bytes can land in a
buffer the caller got back) and turns the whole batch into misses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pegaflow import telemetry
from pegaflow.checksum import checksum
from pegaflow.errors import BadRequest, PegaError, Unavailable, error_from_wire
from pegaflow.rpc import parse_address
from pegaflow.ucx import UcxWorker, close_endpoint, make_tag
from pegaflow.wire import PROTOCOL_VERSION, pack, unpack

log = logging.getLogger(__name__)

_MAX_REPLY = 16 << 20
_MAX_BLOCK = 1 << 30


@dataclass
class PutOutcome:
    """What a put did: blocks stored, already present (skipped), failed."""

    stored: int = 0
    skipped: int = 0
    failed: int = 0


@dataclass
class _NodeConn:
    addr: str
    ep: Any
    node_id: str = ""
    pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    closed: bool = False


def _byte_view(buf: Any) -> memoryview:
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise BadRequest("block buffers must be C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class DataClient:
    """Batched get/put against storage nodes over UCX."""

    def __init__(self, *, token: str | None = None, connect_timeout: float = 2.0) -> None:
        self._token = token or None
        self._connect_timeout = connect_timeout
        self._worker: UcxWorker | None = None
        self._conns: dict[str, _NodeConn] = {}
        self._connecting: dict[str, asyncio.Future[_NodeConn]] = {}
        self._ids = itertools.count(1)
        self._hasher = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pegaflow-xxh3")

    @property
    def worker(self) -> UcxWorker:
        if self._worker is None:
            self._worker = UcxWorker()
        return self._worker

    async def close(self) -> None:
        """Close every endpoint and the worker."""
        for conn in list(self._conns.values()):
            self._drop(conn, Unavailable("client closed"))
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        self._hasher.shutdown(wait=False)

    # ---- connections ---------------------------------------------------------------

    def _drop(self, conn: _NodeConn, err: PegaError) -> None:
        if conn.closed:
            return
        conn.closed = True
        if self._conns.get(conn.addr) is conn:
            del self._conns[conn.addr]
        for fut in conn.pending.values():
            if not fut.done():
                fut.set_exception(err)
        conn.pending.clear()
        close_endpoint(conn.ep)
        if conn.reader is not None and conn.reader is not asyncio.current_task():
            conn.reader.cancel()

    async def _read_loop(self, conn: _NodeConn) -> None:
        w = self.worker
        try:
            while not conn.closed:
                req = w.am_recv(conn.ep)
                fut = w.track(req)
                await fut
                msg = unpack(memoryview(req.recv_buffer).cast("B"), _MAX_REPLY)
                if not isinstance(msg, dict):
                    continue
                waiter = conn.pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)
        except asyncio.CancelledError:
            pass
        except PegaError as e:
            self._drop(conn, Unavailable(f"data connection to {conn.addr} failed: {e}"))

    async def _connection(self, addr: str, deadline: float) -> _NodeConn:
        conn = self._conns.get(addr)
        if conn is not None:
            return conn
        pending = self._connecting.get(addr)
        if pending is None:
            pending = asyncio.ensure_future(self._open(addr, deadline))
            self._connecting[addr] = pending
            pending.add_done_callback(lambda _f: self._connecting.pop(addr, None))
        return await asyncio.shield(pending)

    async def _open(self, addr: str, deadline: float) -> _NodeConn:
        host, port = parse_address(addr)
        ep = await self.worker.connect(host, port, self._connect_timeout)
        conn = _NodeConn(addr, ep)
        conn.reader = asyncio.create_task(self._read_loop(conn))
        try:
            hello = await self._request(
                conn,
                {"op": "hello", "version": PROTOCOL_VERSION, "token": self._token},
                min(self._connect_timeout, max(0.001, deadline - time.monotonic())),
            )
        except PegaError:
            self._drop(conn, Unavailable(f"handshake with {addr} failed"))
            raise
        conn.node_id = str(hello.get("node_id", ""))
        self._conns[addr] = conn
        return conn

    async def _request(
        self, conn: _NodeConn, msg: dict[str, Any], timeout: float
    ) -> dict[str, Any]:
        rid = next(self._ids)
        msg["id"] = rid
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.pending[rid] = fut
        w = self.worker
        send = w.am_send(conn.ep, pack(msg))
        try:
            await asyncio.wait_for(asyncio.gather(w.track(send), fut), timeout)
        except TimeoutError:
            conn.pending.pop(rid, None)
            self._drop(conn, Unavailable(f"{msg['op']} to {conn.addr} timed out"))
            raise Unavailable(
                f"{msg['op']} to {conn.addr} timed out after {timeout:.3f} s"
            ) from None
        reply = fut.result()
        if not reply.get("ok"):
            raise error_from_wire(reply.get("error"))
        return reply

    # ---- operations ----------------------------------------------------------------

    async def _hash_after(self, fut: asyncio.Future[None], view: memoryview) -> int:
        await fut
        return await asyncio.get_running_loop().run_in_executor(self._hasher, checksum, view)

    async def get(
        self, addr: str, ns: str, items: Sequence[tuple[bytes, int, Any]], timeout: float
    ) -> list[bool]:
        """Fetch ``(hash, shard, buffer)`` blocks from the node at ``addr``.

        Returns, per item, True when the block arrived whole and its checksum matched.
        Failures (missing, wrong size, corrupt, node down, timeout) are False, never raised.
        """
        if not items:
            return []
        deadline = time.monotonic() + timeout
        views = [_byte_view(b) for _, _, b in items]
        try:
            conn = await self._connection(addr, deadline)
            w = self.worker
            seq = w.next_seq()
            # Receives go up before the request, so payloads land as expected messages
            # straight in the caller's buffers; the node answers every index (a miss
            # is an empty message), so none of them is left posted.  Each block is
            # hashed (off the loop thread) as soon as it lands, while others still move.
            futs = [w.track(w.tag_recv(conn.ep, v, make_tag(seq, i))) for i, v in enumerate(views)]
            hashed = [
                asyncio.ensure_future(self._hash_after(f, v))
                for f, v in zip(futs, views, strict=True)
            ]
            try:
                reply = await self._request(
                    conn,
                    {
                        "op": "get",
                        "ns": ns,
                        "seq": seq,
                        "blocks": [[h, s] for h, s, _ in items],
                        **telemetry.wire_context(),
                    },
                    max(0.001, deadline - time.monotonic()),
                )
                sums = await asyncio.wait_for(
                    asyncio.gather(*hashed), max(0.001, deadline - time.monotonic())
                )
            except BaseException as e:
                for t in hashed:
                    t.cancel()
                w.forget(futs)
                self._drop(conn, Unavailable(f"get from {addr} failed mid-transfer"))
                if isinstance(e, TimeoutError):
                    raise Unavailable(f"get from {addr} timed out") from None
                raise
            header = reply.get("blocks")
            if not isinstance(header, list) or len(header) != len(items):
                raise Unavailable("malformed get reply")
            ok = [False] * len(items)
            for i, h in enumerate(header):
                if not isinstance(h, list) or len(h) != 3 or h[0] != len(views[i]):
                    continue
                ok[i] = sums[i] == h[2]
                if not ok[i]:
                    log.warning("checksum mismatch on a block from %s: treated as a miss", addr)
            return ok
        except PegaError as e:
            log.info("get of %d blocks from %s failed: %s", len(items), addr, e)
            return [False] * len(items)

    async def put(
        self, addr: str, ns: str, items: Sequence[tuple[bytes, int, Any]], timeout: float
    ) -> PutOutcome:
        """Store ``(hash, shard, buffer)`` blocks on the node at ``addr`` (two-phase).

        Raises a typed error when the node cannot be reached or refuses the batch.
        """
        if not items:
            return PutOutcome()
        deadline = time.monotonic() + timeout
        views = [_byte_view(b) for _, _, b in items]
        loop = asyncio.get_running_loop()
        # checksums are computed off the loop thread while the reservation round-trips
        hashing = asyncio.gather(*(loop.run_in_executor(self._hasher, checksum, v) for v in views))
        try:
            conn = await self._connection(addr, deadline)
            w = self.worker
            reply = await self._request(
                conn,
                {
                    "op": "reserve",
                    "ns": ns,
                    **telemetry.wire_context(),
                    "blocks": [[h, s, len(v)] for (h, s, _), v in zip(items, views, strict=True)],
                },
                max(0.001, deadline - time.monotonic()),
            )
            seq = int(reply["seq"])
            accept = reply.get("accept")
            if not isinstance(accept, list) or len(accept) != len(items):
                self._drop(conn, Unavailable("malformed reserve reply"))
                raise Unavailable("malformed reserve reply")
            futs = [
                w.track(w.tag_send(conn.ep, v, make_tag(seq, i)))
                for i, v in enumerate(views)
                if accept[i]
            ]
            sums = await hashing
            try:
                # the node waits for the payloads before it verifies and commits
                done, _ = await asyncio.gather(
                    self._request(
                        conn,
                        {
                            "op": "commit",
                            "seq": seq,
                            **telemetry.wire_context(),
                            "xxh3": [x if a else None for x, a in zip(sums, accept, strict=True)],
                        },
                        max(0.001, deadline - time.monotonic()),
                    ),
                    asyncio.wait_for(
                        asyncio.gather(*futs), max(0.001, deadline - time.monotonic())
                    ),
                )
            except BaseException:
                w.forget(futs)
                self._drop(conn, Unavailable(f"put to {addr} failed mid-transfer"))
                raise
        except BaseException:
            hashing.cancel()
            raise
        stored = int(done.get("stored", 0))
        n_accepted = sum(1 for a in accept if a)
        return PutOutcome(
            stored=stored, skipped=len(items) - n_accepted, failed=n_accepted - stored
        )

    async def pin(
        self, addr: str, ns: str, blocks: Sequence[tuple[bytes, int]], ttl_s: float, timeout: float
    ) -> list[bool]:
        """Ask the node to keep blocks from eviction for ``ttl_s`` (a read pin between
        lookup and get); per block, whether it is stored and now pinned."""
        if not blocks:
            return []
        deadline = time.monotonic() + timeout
        conn = await self._connection(addr, deadline)
        reply = await self._request(
            conn,
            {
                "op": "pin",
                "ns": ns,
                "ttl_ms": max(1, int(ttl_s * 1000)),
                "blocks": [[h, s] for h, s in blocks],
            },
            max(0.001, deadline - time.monotonic()),
        )
        return [bool(x) for x in reply.get("pinned", [])]

    async def node_id(self, addr: str, timeout: float) -> str:
        """The id the node at ``addr`` announced in its handshake."""
        return (await self._connection(addr, time.monotonic() + timeout)).node_id
