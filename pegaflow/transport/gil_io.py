"""The GIL on hot paths: socket calls that keep it, and quick hand-backs around CUDA calls.

CPython releases the GIL around every socket system call.  In a process where another
thread wants the GIL all the time (vLLM's engine core while its input thread hashes the
blocks of new requests), the thread that released it then waits up to the
interpreter's switch interval (5 ms) to get it back, at every call: a 0.6 ms locate
over a Unix socket took 6 ms p50 / 11 ms p90 from the scheduler's thread with one busy
thread beside it, and 1.4 ms when the round trip kept the GIL (docs/benchmarks.md,
"Same-host control").  These calls go to libc through :class:`ctypes.PyDLL`, which does
not release the GIL; the receive waits for data at most a bounded time (callers bound
it by the switch interval, as long as the interpreter lets any thread keep the GIL)
and then hands back to an ordinary, GIL-releasing wait.

Linux (and other POSIX systems with ``poll``); :data:`AVAILABLE` is False where libc
cannot be loaded this way, and callers use plain socket calls.

CUDA calls release the GIL too: torch's event and stream calls and Triton's kernel
launches each do.  Queueing one 10k-token layer-wise load makes about 200 of them, so
beside a thread that hashes new requests it took 2.0 s instead of 4.3 ms on the H200
(``scripts/bench_copy_issue.py --busy-thread``).  :func:`quick_handback` lowers the
switch interval while a thread queues such work, so it gets the GIL back within
:data:`QUICK_SWITCH_S` after each call.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import math
import sys
import threading
from collections.abc import Iterator

POLLIN = 0x001


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


try:
    _libc = ctypes.PyDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _send = _libc.send
    _send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    _send.restype = ctypes.c_ssize_t
    _recv = _libc.recv
    _recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _recv.restype = ctypes.c_ssize_t
    _poll = _libc.poll
    _poll.argtypes = [ctypes.POINTER(_PollFd), ctypes.c_ulong, ctypes.c_int]
    _poll.restype = ctypes.c_int
    AVAILABLE = True
except (OSError, AttributeError):  # pragma: no cover - no loadable libc
    AVAILABLE = False

MSG_NOSIGNAL = 0x4000
"""a send to a closed peer fails with EPIPE instead of raising SIGPIPE (Linux)"""
_RETRY = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)


def send(fd: int, data: bytes) -> int:
    """Send what the socket takes of ``data`` now, keeping the GIL: the bytes sent (0
    when it takes nothing now; the caller sends the rest its own way).  Raises
    ``OSError`` when the socket fails."""
    n = _send(fd, data, len(data), MSG_NOSIGNAL)
    if n >= 0:
        return n
    err = ctypes.get_errno()
    if err in _RETRY:
        return 0
    raise OSError(err, f"send: {errno.errorcode.get(err, err)}")


class Receiver:
    """Receives into a buffer of its own, keeping the GIL while it waits.

    Args:
        size: the most bytes one :meth:`recv` returns.
    """

    def __init__(self, size: int = 1 << 18) -> None:
        self._buf = ctypes.create_string_buffer(size)
        self._view = memoryview(self._buf).cast("B")
        self._size = size

    def recv(self, fd: int, wait_s: float) -> memoryview | None:
        """Bytes from ``fd``, waiting at most ``wait_s`` (with the GIL held) for them:
        a view valid until the next call, empty when the peer closed, None when nothing
        came in time.  Raises ``OSError`` when the socket fails."""
        pfd = _PollFd(fd, POLLIN, 0)
        ready = _poll(ctypes.byref(pfd), 1, max(0, math.ceil(wait_s * 1000)))
        if ready < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                return None
            raise OSError(err, f"poll: {errno.errorcode.get(err, err)}")
        if ready == 0:
            return None
        n = _recv(fd, self._buf, self._size, 0)
        if n < 0:
            err = ctypes.get_errno()
            if err in _RETRY:
                return None
            raise OSError(err, f"recv: {errno.errorcode.get(err, err)}")
        return self._view[:n]


QUICK_SWITCH_S = 50e-6
"""the interpreter's switch interval inside :func:`quick_handback` (its default: 5 ms)"""
_quick_lock = threading.Lock()
_quick_depth = 0
_quick_saved = 0.0


@contextlib.contextmanager
def quick_handback() -> Iterator[None]:
    """Within this block (in any thread), a thread waiting for the GIL takes it from a
    busy one after :data:`QUICK_SWITCH_S` instead of the interpreter's switch interval.

    For a thread that queues many short GIL-releasing calls (CUDA copies, events,
    kernel launches) while other threads run Python: at each call it would otherwise
    wait up to 5 ms to run again.  The busy threads lose no throughput: they switch
    more often, each time only for as long as the short call took.  Nested and
    concurrent blocks share one lowered interval; the last to leave restores the
    interval found by the first.
    """
    global _quick_depth, _quick_saved
    with _quick_lock:
        if _quick_depth == 0:
            _quick_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_quick_saved, QUICK_SWITCH_S))
        _quick_depth += 1
    try:
        yield
    finally:
        with _quick_lock:
            _quick_depth -= 1
            if _quick_depth == 0:
                sys.setswitchinterval(_quick_saved)
