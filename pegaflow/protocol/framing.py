"""The control protocol's wire format: msgpack frames with request ids, deadlines and
typed errors, over TCP or a Unix socket (:mod:`~pegaflow.transport.rpc_server` serves it,
:mod:`~pegaflow.transport.rpc_client` calls it).

Framing: every frame is a 4-byte big-endian length followed by one msgpack map.

* The client opens with ``{"op": "hello", "version": 1, "token": str | None}``; the
  server answers ``{"ok": True, "version": 1, "server": name}`` or a typed error and
  closes.  A version mismatch or a bad token ends the connection.
* Requests: ``{"id": int, "op": str, "args": map, "deadline_ms": int}``.
* Replies: ``{"id": int, "ok": True, "result": any}`` or
  ``{"id": int, "ok": False, "error": {"code": str, "message": str}}``.

Requests on one connection run concurrently (bounded per connection); replies may come
out of order and are matched by id.  A frame over the size limit gets a ``too_large``
error and the connection is closed (its length prefix cannot be trusted to resync): the
server sends EOF after the error and drops what the client still sends for a while
(``rpc_server.LINGER_S``), so a client still writing reads the error instead of a reset.

Both ends are :class:`asyncio.Protocol` implementations rather than streams: frames are
cut out of one receive buffer (:class:`FrameBuffer`) without a coroutine per frame, and
every reply (or request) produced in one pass goes out in one ``write``, so a busy
connection costs a few system calls per batch of requests rather than per request.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

from pegaflow.errors import TooLarge
from pegaflow.protocol.codec import pack, unpack

FRAME_HEADER = struct.Struct("!I")
"""a frame's length prefix"""
UNIX_PREFIX = "unix:"
"""an address ``unix:<path>`` names a Unix socket (see
:meth:`~pegaflow.transport.rpc_server.RpcServer.start_unix`)"""
DEFAULT_MAX_FRAME = 16 << 20
MAX_DEADLINE_MS = 600_000


def encode_frame(obj: Any) -> bytes:
    """One length-prefixed msgpack frame."""
    body = pack(obj)
    return FRAME_HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> Any:
    """Read and decode one frame; raises TooLarge, BadRequest or IncompleteReadError."""
    (n,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
    if n > max_bytes:
        raise TooLarge(f"frame of {n} bytes exceeds the limit of {max_bytes}")
    return unpack(await reader.readexactly(n), max_bytes)


def parse_address(addr: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) into a tuple."""
    host, sep, port = addr.rpartition(":")
    if not sep:
        if default_port is None:
            raise ValueError(f"address {addr!r} has no port")
        return addr, default_port
    return host.strip("[]"), int(port)


class FrameBuffer:
    """Cuts length-prefixed msgpack frames out of received bytes."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def frames(self, limit: Callable[[], int]) -> Any:
        """Yield each complete frame's decoded message; raises TooLarge for a length
        over ``limit()`` and BadRequest for undecodable msgpack (the connection cannot
        be trusted after either).  Consumed bytes are dropped when the caller stops."""
        buf = self.buf
        pos = 0
        try:
            while len(buf) - pos >= 4:
                (n,) = FRAME_HEADER.unpack_from(buf, pos)
                max_bytes = limit()
                if n > max_bytes:
                    raise TooLarge(f"frame of {n} bytes exceeds the limit of {max_bytes}")
                end = pos + 4 + n
                if len(buf) < end:
                    break
                with memoryview(buf) as mv, mv[pos + 4 : end] as body:
                    msg = unpack(body, max_bytes)
                pos = end
                yield msg
        finally:
            del buf[:pos]
