"""The control protocol over a blocking socket, from the calling thread (no event loop).

Its loop-side sibling is :class:`~pegaflow.transport.rpc_client.RpcClient`; both speak
the wire format of :mod:`pegaflow.protocol.framing`.
"""

from __future__ import annotations

import itertools
import socket
import ssl
import sys
import threading
from collections.abc import Iterator
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any

from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import DeadlineExceeded, PegaError, Unavailable, error_from_wire
from pegaflow.protocol.codec import PROTOCOL_VERSION, req_map
from pegaflow.protocol.framing import (
    DEFAULT_MAX_FRAME,
    UNIX_PREFIX,
    FrameBuffer,
    encode_frame,
    parse_address,
)
from pegaflow.tls import NOT_ANSWERED
from pegaflow.transport import gil_io


@dataclass(eq=False, repr=False)
class BlockingRpcClient:
    """The control protocol over a blocking socket to one address, from the calling
    thread: no event loop, no thread hop.

    A call through :class:`RpcClient` on a loop thread waits for the GIL three times
    (the loop takes the request, then the reply; the caller wakes), and in a process
    whose other threads keep the GIL busy each wait can last the interpreter's switch
    interval (5 ms): vLLM's scheduler asking while its input thread hashed new requests
    waited 3-20 ms for a 1 ms locate on the H200 (docs/benchmarks.md, "Same-host
    control").  Here the call keeps the GIL through its send and, for up to one switch
    interval, its wait for the reply (:mod:`pegaflow.transport.gil_io`), as any thread running
    Python may; a slower reply is waited for the ordinary way.

    One call at a time (a lock).  A connection that breaks or misses a deadline is
    closed (a late reply cannot be told from the next one's) and the next call opens a
    new one.  Errors are typed: ``Unavailable`` when the address cannot be reached or the
    connection breaks, ``DeadlineExceeded``, the server's own errors.

    ``tls``: a TCP address is dialled over TLS with this context.  Such a connection
    waits the ordinary way: the GIL-keeping I/O above moves raw socket bytes, and
    Python's ``ssl`` releases the GIL around every record it encrypts or decrypts
    anyway, so over TLS this client keeps no GIL advantage over the loop's.
    """

    address: str
    _: KW_ONLY
    token: InitVar[str | None] = None
    timeout: float = 5.0
    connect_timeout: InitVar[float] = 1.0
    max_frame: InitVar[int] = DEFAULT_MAX_FRAME
    tls: ssl.SSLContext | None = None
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1), init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _sock: socket.socket | None = field(default=None, init=False)
    _frames: FrameBuffer = field(default_factory=FrameBuffer, init=False)

    def __post_init__(self, token: str | None, connect_timeout: float, max_frame: int) -> None:
        self._token = token
        self._connect_timeout = connect_timeout
        self._max_frame = max_frame
        self._raw_io = gil_io.AVAILABLE and (
            self.tls is None or self.address.startswith(UNIX_PREFIX)
        )
        self._receiver = gil_io.Receiver() if self._raw_io else None

    def close(self) -> None:
        """Close the connection (the next call opens a new one)."""
        sock, self._sock = self._sock, None
        self._frames = FrameBuffer()
        if sock is not None:
            sock.close()

    def call(self, op: str, args: dict[str, Any] | None = None, timeout: Timeout = None) -> Any:
        """Run ``op`` remotely within ``timeout`` (default: the client's), blocking."""
        deadline = Deadline.of(timeout, self.timeout)
        if not self._lock.acquire(timeout=deadline.left()):
            raise DeadlineExceeded(f"{op}: another call on {self.address} held the socket")
        try:
            try:
                sock = self._sock or self._open(deadline)
                rid = next(self._ids)
                frame = {
                    "id": rid, "op": op, "args": args or {},
                    "deadline_ms": max(1, int(deadline.remaining() * 1000)),
                }  # fmt: skip
                data = encode_frame(frame)
                sent = gil_io.send(sock.fileno(), data) if self._raw_io else 0
                if sent < len(data):
                    sock.settimeout(deadline.left())
                    sock.sendall(data[sent:])
                reply = self._reply(sock, rid, deadline)
            except TimeoutError:
                self.close()
                raise DeadlineExceeded(f"{op} to {self.address} got no answer in time") from None
            except OSError as e:
                self.close()
                raise Unavailable(f"{op} to {self.address}: {e}") from None
            except PegaError:
                self.close()
                raise
        finally:
            self._lock.release()
        if reply.get("ok"):
            return reply.get("result")
        raise error_from_wire(reply.get("error"))

    def _open(self, deadline: Deadline) -> socket.socket:
        if self.address.startswith(UNIX_PREFIX):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            where: Any = self.address[len(UNIX_PREFIX) :]
        else:
            where = parse_address(self.address)
            sock = socket.socket(socket.AF_INET6 if ":" in where[0] else socket.AF_INET)
        try:
            sock.settimeout(min(deadline.left(), self._connect_timeout))
            sock.connect(where)
            if self.tls is not None and not isinstance(where, str):
                sock = self.tls.wrap_socket(sock, server_hostname=where[0])
            hello = {"op": "hello", "version": PROTOCOL_VERSION, "token": self._token}
            sock.sendall(encode_frame(hello))
            try:
                reply = req_map(self._next(sock, deadline))
            except ConnectionResetError:
                if self.tls is not None:
                    raise
                raise ConnectionResetError(NOT_ANSWERED) from None
            if not reply.get("ok"):
                raise error_from_wire(reply.get("error"))
        except BaseException:
            sock.close()
            self._frames = FrameBuffer()
            raise
        self._sock = sock
        return sock

    def _reply(self, sock: socket.socket, rid: int, deadline: Deadline) -> dict[str, Any]:
        """The reply to request ``rid`` (replies to earlier, abandoned requests skipped)."""
        while True:
            msg = self._next(sock, deadline)
            if type(msg) is not dict:
                continue
            if msg.get("id") == rid:
                return msg
            if msg.get("id") is None and not msg.get("ok"):
                raise error_from_wire(msg.get("error"))  # the server refused the frame

    def _next(self, sock: socket.socket, deadline: Deadline) -> Any:
        """The next frame from the server, waiting until ``deadline`` (keeping the GIL
        for up to the interpreter's switch interval of it)."""
        hold = deadline.sub(sys.getswitchinterval())
        while True:
            frames = self._frames.frames(lambda: self._max_frame)
            try:
                for msg in frames:
                    return msg
            finally:
                frames.close()
            if deadline.expired:
                raise TimeoutError
            if self._receiver is not None and not hold.expired:
                got = self._receiver.recv(sock.fileno(), hold.remaining())
                if got is None:
                    continue
            else:
                sock.settimeout(deadline.left())
                got = sock.recv(1 << 20)
            if not got:
                raise ConnectionResetError("closed by the server")
            self._frames.buf += got
