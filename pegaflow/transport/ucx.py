"""UCX on an asyncio event loop, through ucxx's low-level API.

Why not ``ucxx``'s own asyncio layer: measured on the development machine, its default
endpoints (peer error handling on, one rendezvous rail) make UCX pick the *fragmented
copy-in/copy-out* rendezvous over TCP, about 0.5-1.2 GB/s for 2 MiB messages, while
``ucx_perftest`` reaches 4-6 GB/s with *zero-copy put* rendezvous.  We therefore:

* create endpoints without UCX peer error handling (dead peers are detected by our own
  deadlines: a transfer past its deadline closes its endpoint, without waiting), and
* set ``UCX_RNDV_SCHEME=put_zcopy`` unless the operator chose otherwise,

and drive the worker from the event loop thread: the worker's epoll fd is registered
with ``loop.add_reader``; every wake-up progresses the worker, runs the completion
callbacks of finished requests (:meth:`UcxWorker.on_done`; a batch waits on one future)
and re-arms.  One thread, no GIL ping-pong with a progress thread.

Nothing here blocks the loop on a peer.  A hung peer (SIGSTOP, a partition, a host that
lost power: the kernel keeps its TCP connection open) used to freeze the loop of the other
side inside ucxx's ``closeBlocking``, which progresses the worker until the peer answers;
endpoints are now closed without waiting (:func:`close_endpoint`).

UCX cannot cancel a receive that already matched its sender's rendezvous: after a timeout
its bytes may still land, up to hundreds of MiB and long after (as soon as a hung peer
resumes; over shared memory and CMA the sender writes straight into the buffer, whatever
the receiver does).  Closing the endpoint does not stop them either.  So a buffer is the
caller's again only when UCX reports each of its requests finished:
:meth:`UcxWorker.settle` calls back when that happens, and the data client and node hold
such buffers and slots out of use until then.

Message conventions used by the node and the client:

* control messages are UCX active messages (per endpoint, any size) holding msgpack;
* bulk payloads are tagged messages straight from/into registered-or-not user buffers,
  tag = ``(seq << 20) | index`` where ``seq`` is chosen by the receiving side so that it
  is unique on the receiver's worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

TAG_INDEX_BITS = 20
_SEQ_MASK = (1 << (64 - TAG_INDEX_BITS)) - 1
_SETTLE_CHECK_S = 0.05
_PROGRESS_ROUNDS = 64
"""progress calls per wake-up before the worker yields the loop to others"""


DEFAULT_TLS = "^cma"
"""our default transports (all but CMA: see :func:`configure_ucx_env`)"""
SHARED_TLS = "^cma,shm"
"""transports for a node whose same-host peers may run as other users: UCX's
shared-memory transports refuse such a peer, so they are off too (same-host data goes
through the pool file anyway)"""


def configure_ucx_env() -> None:
    """Set our UCX defaults in the environment; must run before ucxx is imported."""
    os.environ.setdefault("UCX_RNDV_SCHEME", "put_zcopy")
    # No CMA (process_vm_readv/writev between processes of one host): without peer error
    # handling (above), a peer that dies mid-transfer makes UCX abort this process on
    # its failed process_vm_writev (seen with chaos.py: a killed engine took its node
    # down).  Same-host gets then go through shared memory at 3.7 GiB/s instead of
    # 5.8 (256 MiB, the CPU machine, 2026-12-01); a GPU or CPU connector beside its
    # node copies through the pool file instead and does not use UCX for its data.
    os.environ.setdefault("UCX_TLS", DEFAULT_TLS)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCX_TCP_CM_REUSEADDR", "y")
    # Closing an endpoint whose peer is gone is routine here (we own failure handling
    # and log it with context); UCX would print an ERROR line for each.  Set
    # UCX_LOG_LEVEL=warn / UCXX_LOG_LEVEL=WARN to debug the transport itself.
    os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
    os.environ.setdefault("UCXX_LOG_LEVEL", "FATAL")


configure_ucx_env()

import numpy as np  # noqa: E402

from pegaflow.errors import (  # noqa: E402
    DeadlineExceeded,
    HandshakeRefused,
    UcxNotInstalled,
    Unavailable,
)

try:
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array
except ImportError as e:  # a coordinator or router host installs no UCX: the cu12/cu13 extra
    raise UcxNotInstalled(e) from e

from pegaflow.deadline import Deadline  # noqa: E402
from pegaflow.protocol.codec import pack, unpack  # noqa: E402
from pegaflow.transport.ucx_address import (  # noqa: E402
    MAX_ADDRESS_BYTES,
    InvalidWorkerAddress,
    check_peer_address,
    peer_on_this_host,
)

_Done = Callable[[BaseException | None], None]
"""A completion callback: ``None`` on success, the (typed) error otherwise."""


def expire(fut: asyncio.Future[Any], timeout: float) -> None:
    """Fail ``fut`` with DeadlineExceeded unless it is done (a ``call_later`` target)."""
    if not fut.done():
        fut.set_exception(DeadlineExceeded(f"UCX transfer not done within {timeout:.3f} s"))


def make_tag(seq: int, index: int) -> Any:
    """The tag of payload ``index`` of request ``seq``."""
    return ucx_api.UCXXTag(((seq & _SEQ_MASK) << TAG_INDEX_BITS) | index)


def as_array(buf: Any) -> Any:
    """Wrap a buffer-protocol object (numpy array, memoryview, tensor.numpy()) for ucxx."""
    return buf if isinstance(buf, Array) else Array(buf)


class UcxWorker:
    """A UCX worker progressed by the running asyncio loop.

    ``await worker.wait(request, timeout)`` completes when UCX finishes the request,
    raising :class:`~pegaflow.errors.Unavailable` on a UCX error and
    :class:`~pegaflow.errors.DeadlineExceeded` on timeout.
    """

    def __init__(self, config: dict[str, str] | None = None) -> None:
        """``config``: UCX options for this worker's context only, without the ``UCX_``
        prefix (e.g. ``{"NET_DEVICES": "lo"}``); they override the environment."""
        self._loop = asyncio.get_running_loop()
        self.context = ucx_api.UCXContext(
            config_dict=dict(config or {}),
            feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.AM, ucx_api.Feature.WAKEUP),
        )
        self.worker = ucx_api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self._fd = self.worker.epoll_file_descriptor
        # (request, completion callback, key for forget())
        self._pending: list[tuple[Any, _Done, object]] = []
        self._scheduled = False
        self._closed = False
        self._loop.add_reader(self._fd, self._progress)
        self._seq = 0
        self._keep: dict[int, tuple[Any, Any]] = {}
        # requests someone waits to see finished (see settle()), and the timer checking them
        self._settling: list[tuple[list[Any], Callable[[], None]]] = []
        self._settle_timer: asyncio.TimerHandle | None = None
        self._refusals = _Refusals()

    def next_seq(self) -> int:
        """A sequence number unique on this worker, for payload tags."""
        self._seq = (self._seq + 1) & _SEQ_MASK
        return self._seq

    def kick(self) -> None:
        """Progress soon (after posting requests: posting alone raises no fd event)."""
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self._loop.call_soon(self._progress)

    def _progress(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        w = self.worker
        w.progress()
        self._reap()
        for _ in range(_PROGRESS_ROUNDS):
            if w.arm():
                return
            w.progress()
            self._reap()
        # still busy (bulk transfers keep the worker's events coming): go on after what
        # else is ready on the loop (control requests, timers), not before it
        self.kick()

    def _reap(self) -> None:
        if not self._pending:
            return
        # callbacks may register new requests: those go to a fresh list
        pending, self._pending = self._pending, []
        still: list[tuple[Any, _Done, object]] = []
        keep = self._keep
        for entry in pending:
            req = entry[0]
            if not req.completed:
                still.append(entry)
                continue
            if keep:
                keep.pop(id(req), None)
            try:
                req.check_error()
            except Exception as e:
                entry[1](Unavailable(f"UCX transfer failed: {type(e).__name__}: {e}"))
            else:
                entry[1](None)
        if self._pending:
            still.extend(self._pending)
        self._pending = still

    def on_done(self, req: Any, done: _Done, key: object = None) -> None:
        """Call ``done(None)`` when ``req`` completes, ``done(Unavailable(...))`` when it
        fails; ``key`` groups requests for :meth:`forget`.

        The callback runs on the loop thread inside the worker's progress, as soon as the
        completion is seen (no task, no future): it must be short, must not block on
        the network and must not call :meth:`forget`.
        """
        self._pending.append((req, done, key))
        self.kick()

    def track(self, req: Any) -> asyncio.Future[None]:
        """A future that completes with ``req``."""
        fut: asyncio.Future[None] = self._loop.create_future()

        def done(err: BaseException | None) -> None:
            if not fut.done():
                if err is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(err)

        self.on_done(req, done, fut)
        return fut

    async def wait(self, req: Any, timeout: float | Deadline) -> None:
        """Wait for one request; see :meth:`wait_all`."""
        await self.wait_all([req], timeout)

    async def wait_all(self, reqs: list[Any], timeout: float | Deadline) -> None:
        """Wait for all requests, raising DeadlineExceeded when ``timeout`` passes.

        UCX cannot cancel a request that is under way: after a timeout or error the
        caller closes the endpoint (:func:`close_endpoint`) and must not reuse or free
        a buffer of those requests before :meth:`settle` says they finished.
        """
        if not reqs:
            return
        # one future and one timer for the whole batch, not a future per request
        fut: asyncio.Future[None] = self._loop.create_future()
        left = len(reqs)

        def done(err: BaseException | None) -> None:
            nonlocal left
            if fut.done():
                return
            if err is not None:
                fut.set_exception(err)
                return
            left -= 1
            if not left:
                fut.set_result(None)

        self._pending.extend((r, done, fut) for r in reqs)
        self.kick()
        budget = Deadline.of(timeout).left()
        timer = self._loop.call_later(budget, expire, fut, budget)
        try:
            await fut
        finally:
            timer.cancel()
            if left:
                self.forget([fut])

    def forget(self, keys: list[Any]) -> None:
        """Stop tracking the requests registered under ``keys`` (futures from
        :meth:`track`, or keys given to :meth:`on_done`); unfinished futures among them
        are cancelled.  The requests' endpoint must be closed (see :meth:`wait_all`)."""
        drop = {id(k) for k in keys}
        for k in keys:
            if isinstance(k, asyncio.Future) and not k.done():
                k.cancel()
        self._pending = [e for e in self._pending if id(e[2]) not in drop]

    def settle(self, reqs: list[Any], then: Callable[[], None]) -> None:
        """Call ``then()`` once every request in ``reqs`` has finished, done or failed
        (and so nothing can touch its buffer any more), however long that takes.

        For the buffers of requests given up on (a timeout, a closed endpoint): a
        request UCX is still serving may write its buffer at any later time.  With a
        peer that died, that may be never: the buffer then stays held for good (the
        callers count such bytes).  Checked every 50 ms, not in the progress path.
        """
        left = [r for r in reqs if not r.completed]
        if not left:
            then()
            return
        self._settling.append((left, then))
        if self._settle_timer is None and not self._closed:
            self._settle_timer = self._loop.call_later(_SETTLE_CHECK_S, self._check_settling)

    def _check_settling(self) -> None:
        self._settle_timer = None
        if self._closed:
            return
        still: list[tuple[list[Any], Callable[[], None]]] = []
        for reqs, then in self._settling:
            left = [r for r in reqs if not r.completed]
            if left:
                still.append((left, then))
                continue
            try:
                then()
            except Exception:  # a caller's bug must not stop the others settling
                log.exception("settle callback failed")
        self._settling = still
        if still:
            self._settle_timer = self._loop.call_later(_SETTLE_CHECK_S, self._check_settling)

    async def serve(
        self, host: str, port: int, on_endpoint: Callable[[Any], None]
    ) -> asyncio.Server:
        """Accept connections on ``host:port`` (a TCP socket bound there, nowhere else);
        ``on_endpoint(ep)`` is called for each.

        ucxx's own connection listener binds every interface (it takes a port only), so
        endpoints are set up by exchanging UCX worker addresses over this socket
        instead: the peer sends its address, we create an endpoint to it and answer
        with ours (see :meth:`connect`).  Payloads then flow over UCX's transports,
        which ``UCX_NET_DEVICES`` restricts to the configured interface.
        """

        async def handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                    peer = await _read_address(reader, writer, self.address)
                    ep = ucx_api.UCXEndpoint.create_from_worker_address(
                        self.worker, ucx_api.UCXAddress.create_from_buffer(peer), False
                    )
                    writer.write(_frame(self.address))
                    await writer.drain()
            except Exception as e:  # a bad or slow peer: refused, and told why
                self._refusals.refuse(writer, e)
                return
            writer.close()
            self.kick()
            on_endpoint(ep)

        server = await asyncio.start_server(handshake, host, port, reuse_address=True)
        self.kick()
        return server

    @property
    def address(self) -> bytes:
        """This worker's UCX address (what a peer needs to reach it)."""
        return bytes(self.worker.address.tobytes())

    async def connect(self, host: str, port: int, timeout: float | Deadline) -> Any:
        """An endpoint to the worker serving ``host:port`` (see :meth:`serve`); raises
        :class:`~pegaflow.errors.HandshakeRefused` with the peer's reason when it
        refuses us, ``Unavailable`` when it cannot be reached or answers nonsense."""
        try:
            async with asyncio.timeout(Deadline.of(timeout).left()):
                reader, writer = await asyncio.open_connection(host, port)
                try:
                    writer.write(_frame(self.address))
                    await writer.drain()
                    peer = await _read_address(reader, writer, self.address, answer=True)
                finally:
                    writer.close()
            ep = ucx_api.UCXEndpoint.create_from_worker_address(
                self.worker, ucx_api.UCXAddress.create_from_buffer(peer), False
            )
        except TimeoutError:
            raise Unavailable(f"UCX handshake with {host}:{port} timed out") from None
        except HandshakeRefused as e:
            raise HandshakeRefused(f"{host}:{port} refused our UCX connection: {e}") from None
        except Exception as e:
            raise Unavailable(f"cannot connect to UCX {host}:{port}: {e}") from None
        self.kick()
        return ep

    def am_send(self, ep: Any, data: bytes) -> Any:
        """Post an active message holding ``data``."""
        arr = Array(np.frombuffer(data, dtype=np.uint8))
        req = ep.am_send(arr)
        # UCX reads the buffer when the send leaves, which may be after wire-up
        self._keep[id(req)] = (req, arr)
        self.kick()
        return req

    def am_recv(self, ep: Any) -> Any:
        """Post the receive of the next active message from ``ep``."""
        req = ep.am_recv()
        self.kick()
        return req

    def tag_send(self, ep: Any, buf: Any, tag: Any) -> Any:
        req = ep.tag_send(as_array(buf), tag)
        return req

    def tag_recv(self, ep: Any, buf: Any, tag: Any) -> Any:
        return ep.tag_recv(as_array(buf), tag)

    def close(self) -> None:
        """Stop progressing; cancel everything in flight."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        if self._settle_timer is not None:
            self._settle_timer.cancel()
            self._settle_timer = None
        pending, self._pending = self._pending, []
        for _req, _done, key in pending:
            if isinstance(key, asyncio.Future) and not key.done():
                key.cancel()
        try:
            self.worker.cancel_inflight_requests(period=0, max_attempts=1)
        except Exception:
            pass


HANDSHAKE_TIMEOUT_S = 5.0
MAX_REFUSAL_BYTES = 1024
"""longest reason a refused handshake carries"""
_REFUSAL_LOG_EVERY_S = 10.0


def _frame(address: bytes) -> bytes:
    return len(address).to_bytes(4, "big") + address


def _refusal(e: BaseException) -> bytes:
    """A handshake answer that refuses the peer and says why: a zero length (no
    address), then a frame of msgpack ``{code, message}``."""
    why = "handshake timed out" if isinstance(e, TimeoutError) else f"{e}" or type(e).__name__
    body = pack({"code": HandshakeRefused.code, "message": why[:MAX_REFUSAL_BYTES]})
    return b"\0\0\0\0" + _frame(body)


async def _read_address(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    own: bytes,
    *,
    answer: bool = False,
) -> bytes:
    """The peer's worker address, once :mod:`pegaflow.transport.ucx_address` found it one that
    our worker (address ``own``) may take; ValueError otherwise.  ``answer``: this is
    the node's answer to our handshake, which may be a refusal instead
    (:class:`~pegaflow.errors.HandshakeRefused` with its reason)."""
    n = int.from_bytes(await reader.readexactly(4), "big")
    if n == 0 and answer:
        m = int.from_bytes(await reader.readexactly(4), "big")
        if not 0 < m <= MAX_REFUSAL_BYTES + 64:
            raise InvalidWorkerAddress(f"bad refusal length {m}")
        why = unpack(await reader.readexactly(m), MAX_REFUSAL_BYTES + 64)
        msg = why.get("message") if isinstance(why, dict) else None
        raise HandshakeRefused(str(msg)[:MAX_REFUSAL_BYTES] if msg else "no reason given")
    if not 0 < n <= MAX_ADDRESS_BYTES:
        raise InvalidWorkerAddress(f"bad UCX address length {n}")
    peer = await reader.readexactly(n)
    return check_peer_address(peer, own, from_this_host=peer_on_this_host(writer))


class _Refusals:
    """Refuses handshakes, telling the peer why, and logs them: a refused address at
    WARNING (a client that cannot use this node until its operator acts), anything
    else (a timeout, a frame cut short) at INFO; at most one line per
    :data:`_REFUSAL_LOG_EVERY_S` of each, counting the ones not logged."""

    def __init__(self) -> None:
        self._next: dict[int, float] = {}
        self._quiet: dict[int, int] = {}

    def refuse(self, writer: asyncio.StreamWriter, e: BaseException) -> None:
        try:
            writer.write(_refusal(e))
        except Exception:  # the peer is gone already
            pass
        writer.close()
        level = logging.WARNING if isinstance(e, InvalidWorkerAddress) else logging.INFO
        now = time.monotonic()
        if now < self._next.get(level, 0.0):
            self._quiet[level] = self._quiet.get(level, 0) + 1
            return
        self._next[level] = now + _REFUSAL_LOG_EVERY_S
        quiet = self._quiet.pop(level, 0)
        log.log(
            level,
            "refused a UCX connection from %s: %s (the client is told why)%s",
            writer.get_extra_info("peername"),
            "handshake timed out" if isinstance(e, TimeoutError) else str(e) or type(e).__name__,
            f"; {quiet} more refused since the last such line" if quiet else "",
        )


_closing: list[Any] = []
"""close requests still under way (kept referenced until they finish)"""


def close_endpoint(ep: Any) -> None:
    """Start closing an endpoint and return at once: never waits on the peer, which may be
    hung (ucxx's ``close_blocking`` progresses the worker until the peer answers).

    Requests still in flight on it are not thereby finished: see :meth:`UcxWorker.settle`.
    """
    _closing[:] = [r for r in _closing if not r.completed]
    try:
        req = ep.close()
    except Exception:
        log.debug("endpoint close failed", exc_info=True)
        return
    if req is not None:
        _closing.append(req)
