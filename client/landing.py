"""The landing buffers of the client's gets, and the caller's buffers they must not write.

Late bytes.  UCX cannot cancel a receive that is under way, and closing its endpoint does
not stop it: the bytes of a get that gave up may land in its buffers long after it
returned (at once over shared memory, or when a hung node resumes: 180-250 MiB of a
256 MiB get did, ``tests/integration/test_late_bytes.py``).  So a get receives into the client's own
*landing buffers* and copies each verified block into the caller's buffer as its last
step (:meth:`Fetched.deliver`): a caller's buffer is never a UCX target.  A landing buffer
goes back to its pool (:data:`LANDING_KEEP_BYTES` kept) only once UCX reports its receive
finished.  The copy costs: 0.60-0.83x the throughput of a zero-copy get (batches of 32
blocks of 2-8 MiB over shared memory and TCP, one client reusing its landing buffers;
a new client's first get also faults their pages in: 0.55-0.75x; 2-core machine,
interleaved A/B).

A caller that manages settlement itself (the vLLM connector, which receives into its own
staging memory and reuses a buffer only once settled) may pass ``zero_copy=True``: UCX
then receives straight into its buffers, which stay *unsettled* while the get is under
way and, after a failed get, until UCX reports each receive finished.
:meth:`DataClient.settled` tells it when a buffer may be reused, and a get into an
unsettled buffer is refused (all misses) rather than verified and then overwritten.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pegaflow.checksum import checksum
from pegaflow.errors import BadRequest
from pegaflow.transport.ucx import UcxWorker, as_array

log = logging.getLogger(__name__)

LANDING_KEEP_BYTES = 256 << 20
"""free landing buffers kept for the next gets (more are freed): one 256 MiB get reuses
its buffers without faulting in new pages"""


class Landing:
    """The payloads of one get: each block's xxh3, taken the moment it lands, and one
    future that completes when every block has landed (or fails with the first error)."""

    __slots__ = ("fut", "left", "reqs", "sums", "views")

    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self.sums: list[int | None] = [None] * len(views)
        self.left = len(views)
        self.fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.reqs: list[Any] = []
        """the receive requests, one per view"""

    def callback(self, i: int) -> Callable[[BaseException | None], None]:
        """The completion callback of block ``i``'s receive."""
        return functools.partial(self._landed, i)

    def _landed(self, i: int, err: BaseException | None) -> None:
        fut = self.fut
        if fut.done():
            return
        if err is not None:
            fut.set_exception(err)
            return
        self.sums[i] = checksum(self.views[i])
        self.left -= 1
        if not self.left:
            fut.set_result(None)


def byte_view(buf: Any) -> memoryview:
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise BadRequest("block buffers must be C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _span(view: memoryview) -> tuple[int, int]:
    """The address range ``[start, end)`` of a byte view."""
    start = as_array(view).ptr if len(view) else 0
    return start, start + len(view)


class Unsettled:
    """The caller's buffers that receives of zero-copy gets may write (see the module
    docstring): while a get is under way, and after it failed until UCX reports its
    unfinished receives finished."""

    def __init__(self) -> None:
        self._spans: dict[int, list[tuple[int, int]]] = {}
        self._ids = itertools.count()
        self.bytes = 0
        """what failed gets' unfinished receives may still write (landing buffers too)"""

    def claim(self, views: Sequence[memoryview]) -> int | None:
        """Register the buffers of a zero-copy get; None (nothing registered) when one of
        them overlaps a buffer still registered."""
        spans = [_span(v) for v in views]
        if self._overlap(spans):
            return None
        key = next(self._ids)
        self._spans[key] = spans
        return key

    def release(self, key: int | None) -> None:
        """Nothing writes the buffers of claim ``key`` any more."""
        if key is not None:
            self._spans.pop(key, None)

    def hold(
        self,
        worker: UcxWorker,
        landing: Landing,
        key: int | None,
        then: Callable[[list[int]], None] | None = None,
    ) -> list[int]:
        """After a failed get: the buffers of ``landing`` whose receives are unfinished
        are held until UCX reports those finished (the buffers of claim ``key`` stay
        registered until then, the claim's others are released now); ``then(indexes)``
        runs then.  Returns their indexes."""
        open_ = [i for i, r in enumerate(landing.reqs) if not r.completed]
        if not open_:
            self.release(key)
            return []
        if key is not None:
            self._spans[key] = [_span(landing.views[i]) for i in open_]
        n = sum(len(landing.views[i]) for i in open_)
        self.bytes += n
        log.warning(
            "%d bytes of a failed get may still be written by UCX; those buffers are held "
            "until their receives finish",
            n,
        )

        views = landing.views  # kept alive while UCX may write them

        def settled() -> None:
            views.clear()
            self.release(key)
            self.bytes -= n
            if then is not None:
                then(open_)

        worker.settle([landing.reqs[i] for i in open_], settled)
        return open_

    def overlaps(self, views: Sequence[memoryview]) -> bool:
        """Whether any byte of ``views`` may be written by a zero-copy get."""
        return bool(self._spans) and self._overlap([_span(v) for v in views])

    def _overlap(self, spans: Sequence[tuple[int, int]]) -> bool:
        if not self._spans:
            return False
        held = [sp for group in list(self._spans.values()) for sp in group]
        return any(a < hb and ha < b for a, b in spans for ha, hb in held)


class LandingPool:
    """The client's own receive buffers, one per block (see the module docstring): taken
    by a get, given back once copied out or once no receive can write them any more;
    up to :data:`LANDING_KEEP_BYTES` of them kept.  Thread-safe: a blocking caller
    delivers on its own thread."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, sizes: Sequence[int]) -> list[np.ndarray]:
        """One buffer of each size (kept ones first)."""
        with self._lock:
            got = [self._pop(n) for n in sizes]
        return [np.empty(n, np.uint8) if b is None else b for b, n in zip(got, sizes, strict=True)]

    def _pop(self, n: int) -> np.ndarray | None:
        free = self._free.get(n)
        if not free:
            return None
        self._kept -= n
        return free.pop()

    def give(self, bufs: Sequence[np.ndarray]) -> None:
        """Buffers no receive can write any more (freed beyond what is kept)."""
        with self._lock:
            for b in bufs:
                if self._kept + b.nbytes <= LANDING_KEEP_BYTES:
                    self._free.setdefault(b.nbytes, []).append(b)
                    self._kept += b.nbytes


class Fetched:
    """A get's answer before its last step: per item, whether its block arrived whole and
    matched its checksum (:attr:`ok`), with the copies of those blocks from the client's
    landing buffers into the caller's that only :meth:`deliver` makes (none for a
    zero-copy get).  Whoever answers the caller delivers, or discards when the caller
    gave up: nothing else ever writes the caller's buffers."""

    __slots__ = ("_copies", "_then", "ok")

    def __init__(
        self,
        ok: list[bool],
        copies: Sequence[tuple[np.ndarray, np.ndarray]] = (),
        then: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.ok = ok
        self._copies = list(copies)
        """(caller's buffer, landing buffer) of each verified block"""
        self._then = list(then)
        """what gives the landing buffers back"""

    @classmethod
    def joined(cls, ok: list[bool], parts: Sequence[Fetched]) -> Fetched:
        """Several gets' answers (of disjoint items) as one; ``ok``: per item of all."""
        return cls(
            ok,
            [c for p in parts for c in p._copies],
            [t for p in parts for t in p._then],
        )

    def deliver(self) -> list[bool]:
        """Copy each verified block into the caller's buffer (once); :attr:`ok`."""
        for dst, src in self._copies:
            np.copyto(dst, src)
        self.discard()
        return self.ok

    def discard(self) -> None:
        """Give the landing buffers back without writing the caller's."""
        then, self._copies, self._then = self._then, [], []
        for t in then:
            t()
