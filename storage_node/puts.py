"""The node's put path: ``reserve``, ``commit``, ``taken`` and ``abort``.

A reservation belongs to the session that made it (:mod:`~pegaflow.storage_node.sessions`):
``commit`` of another's ``seq`` is ``bad_request`` as for an unknown one, ``abort`` of it
is a no-op (``{}``, as for an expired one) and touches nothing; the end of a session
drops its reservations, but for those whose commit was taken (the node carries those
out, and logs how they ended).  A reservation not committed within
``[node] reserve_timeout_s`` expires.

Payloads come over the session's transport (its :class:`~.sessions.Inflow`: the commit
waits on it, then verifies every block's xxh3 against the writer's), or, from a client
on the node's host that maps the pool file, through the file itself:

* ``reserve`` with ``local: true`` posts no receives and answers ``offsets``: the writer
  fills the slots through the file, then ``commit``s; its ``xxh3`` entries may be None,
  and the node's own hash of each slot becomes the block's checksum (no transport lies
  between writer and slot: hashing the same bytes twice would check nothing);
* ``commit`` may carry ``digest``, a signed 64-bit digest per block the writer computed
  on its device; the node keeps it with the block (not journaled) and ``locate`` returns
  it, so a GPU reader can verify what landed in its KV cache on the device.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pegaflow.storage_node.blocks import Entry
from pegaflow.storage_node.sessions import Inflow, Session

from pegaflow.checksum import checksums
from pegaflow.errors import BadRequest, PegaError, Unauthorized, Unavailable
from pegaflow.protocol import node as proto
from pegaflow.protocol.codec import check_namespace

if TYPE_CHECKING:
    from pegaflow.storage_node.node_service import NodeService

log = logging.getLogger(__name__)

_SWEEP_S = 1.0


@dataclass(eq=False)
class _Reservation:
    ns: str
    entries: list[Entry | None]
    """per requested block; None: stored already"""
    owner: Session
    deadline: float
    inflow: Inflow | None
    """None: written through the pool file (no transport between writer and slot)"""
    nbytes: int = 0
    """bytes charged to its owner's quotas (its slots: :func:`.sessions.charge`)"""
    committing: bool = False
    """its commit was taken: the node carries it out, its owner's end does not drop it"""


class Puts:
    """The put path of a :class:`~.node_service.NodeService` (its reservations, the
    commits taken, the hashing threads and the expiry of reservations)."""

    def __init__(self, service: NodeService) -> None:
        self._svc = service
        self.pool = service.pool
        self.cfg = service.cfg
        self.metrics = service.metrics
        self._reservations: dict[int, _Reservation] = {}
        self._commits: dict[int, tuple[Session, asyncio.Task[dict[str, Any]]]] = {}
        """commits taken and not yet carried out, by reservation"""
        self._seqs = itertools.count(1)
        self._sweeper: asyncio.Task[None] | None = None
        # xxh3 releases the GIL: verify puts off the loop thread
        self._hash_threads = self.cfg.hash_threads or min(8, os.cpu_count() or 1)
        self._hasher = concurrent.futures.ThreadPoolExecutor(self._hash_threads, "pegaflow-xxh3")

    def start(self) -> None:
        """Start expiring reservations (on the data loop)."""
        self._sweeper = asyncio.create_task(self._sweep())

    async def finish_commits(self) -> None:
        """Wait for the commits taken, at most ``reserve_timeout_s``."""
        if self._commits:
            await asyncio.wait(
                [t for _, t in self._commits.values()], timeout=self.cfg.reserve_timeout_s
            )

    def close(self) -> None:
        """Stop expiring and hashing (after :meth:`finish_commits`)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._hasher.shutdown(wait=False)

    def end_session(self, session: Session) -> None:
        """Drop ``session``'s reservations, but for those whose commit was taken."""
        for seq, r in list(self._reservations.items()):
            if r.owner is session and not r.committing:
                self._abort(seq)

    def reserve(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        """A reservation of the session's (who may commit or abort it, charged for its
        bytes); its payloads come through the session's transport, or (``local``)
        through the pool file."""
        ns = check_namespace(msg.get("ns"))
        local = proto.reserve_is_local(msg)
        if s.receive is None and not local:
            raise BadRequest("the control socket takes same-host (local) reservations only")
        if local and (not self.cfg.local_access or s.tenant is not None):
            raise Unauthorized("this connection may not write the pool file directly")
        if local:
            proto.check_reserve_pool(msg, self.pool.file_id, str(self.pool.path))
        parsed = proto.decode_reserve_blocks(ns, msg, self.cfg.max_batch)
        quotas = self._svc.quotas
        quotas.check_reserve(s, parsed)
        seq = next(self._seqs)
        entries: list[Entry | None] = []
        inflow: Inflow | None = None
        try:
            for key, size in parsed:
                # the pool's own expiry is a backstop behind ours (_sweep -> _abort),
                # which knows whether payloads may still land in the slot
                entries.append(self.pool.reserve(key, size, 2 * self.cfg.reserve_timeout_s))
            if not local:
                assert s.receive is not None
                slots = [(i, self.pool.view(e)) for i, e in enumerate(entries) if e is not None]
                inflow = s.receive(seq, slots)
        except PegaError:
            for e in entries:
                if e is not None:
                    self.pool.abort(e)
            raise
        nbytes = sum(e.stride for e in entries if e is not None)  # = charge(size)
        quotas.reserved(s, nbytes)
        deadline = time.monotonic() + self.cfg.reserve_timeout_s
        self._reservations[seq] = _Reservation(ns, entries, s, deadline, inflow, nbytes)
        if inflow is not None:
            inflow.done.add_done_callback(lambda f: self._inflow_ended(seq, inflow, f))
        return proto.encode_reserve_reply(msg, seq, [e and e.offset for e in entries])

    def _inflow_ended(self, seq: int, inflow: Inflow, f: asyncio.Future[None]) -> None:
        if not f.cancelled() and f.exception() is not None and seq in self._reservations:
            inflow.cut()  # payloads never came: the transport's receives must die with it

    def commit(self, msg: dict[str, Any], s: Session) -> asyncio.Future[dict[str, Any]]:
        """Take a commit: checked here, then carried out by :meth:`_carry_out` in a task
        of its own, which neither the end of the session nor its deadline cancels.
        Returns a future of the reply.  Plain, not async: the commit is taken as soon as
        the data loop sees it, before the session's next request (a ``taken`` right
        behind it) or its end."""
        seq, sums, digests = proto.decode_commit(msg, self.cfg.max_batch)
        res = self._reservations.get(seq)
        if res is None or res.owner is not s or res.committing:
            raise BadRequest(
                f"no reservation {seq} on this connection (expired, aborted or committed?)"
            )
        if len(sums) != len(res.entries) or (
            digests is not None and (not isinstance(digests, list) or len(digests) != len(sums))
        ):
            self._abort(seq)
            raise BadRequest("commit must carry one checksum (and digest) per reserved block")
        res.committing = True
        task = asyncio.ensure_future(self._carry_out(seq, res, sums, digests))
        self._commits[seq] = (s, task)
        task.add_done_callback(lambda t: self._commit_done(seq, res, t))
        return asyncio.shield(task)

    def taken(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        """``taken``: whether the session's commit of ``seq`` is held (being carried out)."""
        held = self._commits.get(proto.decode_seq(msg))
        return {"taken": held is not None and held[0] is s}

    def _commit_done(self, seq: int, res: _Reservation, task: asyncio.Task[Any]) -> None:
        self._commits.pop(seq, None)
        if task.cancelled() or not res.owner.gone:
            return  # the writer has the outcome (or the node is closing)
        e = task.exception()
        if e is not None:
            log.warning(
                "reservation %d: the commit its writer sent before it went away failed "
                "(%s); its blocks are not stored",
                seq, e,
            )  # fmt: skip
        else:
            log.info(
                "reservation %d committed (%d blocks) after its writer went away",
                seq, task.result()["stored"],
            )  # fmt: skip

    async def _carry_out(
        self, seq: int, res: _Reservation, sums: list[Any], digests: list[Any] | None
    ) -> dict[str, Any]:
        """Wait for the payloads, verify (or, for a same-host reservation, hash) every
        block, commit and publish them."""
        if res.inflow is not None:
            try:
                await asyncio.shield(res.inflow.done)
            except PegaError as e:
                self._abort(seq)
                self.metrics.transfer_errors.labels(kind=e.code).inc()
                raise
        if self._take_reservation(seq) is not res:  # aborted or committed meanwhile
            raise BadRequest(f"reservation {seq} was dropped while its payloads arrived")
        if (failed_pool := self.pool.check_file()) is not None:  # hashing would SIGBUS
            for e in res.entries:
                if e is not None:
                    self.pool.abort(e)
            raise Unavailable(failed_pool)
        got_sums = await self._checksums([self.pool.view(e) for e in res.entries if e is not None])
        got_iter = iter(got_sums)
        local = res.inflow is None
        sink = self._svc.sink
        stored, failed, nbytes = 0, [], 0
        for i, (e, want) in enumerate(zip(res.entries, sums, strict=True)):
            if e is None:
                continue
            got = next(got_iter)
            if not (local and want is None) and (not isinstance(want, int) or got != want):
                self.metrics.checksum_failures.inc()
                self.pool.abort(e)
                failed.append(i)
                continue
            d = None if digests is None else proto.digest_of(digests[i])
            loc = self.pool.commit(e, got, d)
            sink.publish(e.key[0], e.key[1], e.key[2], loc)
            stored += 1
            nbytes += e.size
        self.metrics.put_bytes.inc(nbytes)
        self.metrics.put_blocks.inc(stored)
        self._svc.changed()
        return {"stored": stored, "failed": failed}

    async def _checksums(self, views: list[Any]) -> list[int]:
        """xxh3 of each view, on the hashing threads: one task per thread, not per block
        (a 10k-token prefix is 625 blocks; a task each cost the loop more than a slice)."""
        if not views:
            return []
        loop = asyncio.get_running_loop()
        step = -(-len(views) // self._hash_threads)
        parts = await asyncio.gather(
            *(
                loop.run_in_executor(self._hasher, checksums, views[i : i + step])
                for i in range(0, len(views), step)
            )
        )
        return [x for part in parts for x in part]

    def abort(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        """``abort``: drop reservation ``seq`` if it is the session's; another's is left
        alone, as an unknown or expired one is."""
        seq = proto.decode_seq(msg)
        res = self._reservations.get(seq)
        if res is not None and res.owner is s and not res.committing:
            self._abort(seq)
        return {}

    def _take_reservation(self, seq: int) -> _Reservation | None:
        """Remove reservation ``seq`` and give its bytes back to its owner's quotas."""
        res = self._reservations.pop(seq, None)
        if res is not None and res.nbytes:
            self._svc.quotas.reserved(res.owner, -res.nbytes)
        return res

    def _abort(self, seq: int) -> None:
        res = self._take_reservation(seq)
        if res is None:
            return
        inflow = res.inflow
        if inflow is not None and not inflow.done.done():
            inflow.cut()
        landing = set() if inflow is None else set(inflow.landing())
        for i, e in enumerate(res.entries):
            if e is None:
                continue
            if i not in landing:
                self.pool.abort(e)
                continue
            # the writer's bytes may still land in this slot (giving the transport up
            # does not stop a receive its sender matched): out of use until none can
            assert inflow is not None
            self.pool.quarantine(e)
            inflow.when_landed(i, lambda e=e: self.pool.release_quarantined(e))

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_S)
            now = time.monotonic()
            for seq, r in list(self._reservations.items()):
                if r.deadline < now:
                    log.info("reservation %d expired; reclaiming its slots", seq)
                    self._abort(seq)
            self.pool.reclaim_expired(now)
