"""Leader election through etcd, for duties exactly one coordinator must run (the index
GC, :mod:`pegaflow.coordinator.gc`).

Every coordinator campaigns for the key ``election/<duty>``: one transaction writes the
key under a lease of the candidate's own *only if the key does not exist* (its create
revision is 0).  The candidate whose write lands is the leader for as long as its lease
lives; it keeps the lease alive every ``ttl / 3`` seconds.  The others watch the key and
campaign again the moment it is deleted, which etcd does by itself when a dead leader's
lease expires: at most ``ttl`` seconds after the leader's last keep-alive, so a killed
leader is replaced within ``ttl`` (plus one campaign round trip).  A leader that resigns
(:meth:`Election.close`) revokes its lease and is replaced at once.

Safety: a leader counts itself leader only until ``t + granted TTL``, where ``t`` is
when it *sent* its last successful keep-alive; etcd cannot expire the lease before that,
so two coordinators never both believe they lead (clock rates aside).  Writes made as
leader also carry :meth:`Election.fence` (the key's create revision must still be the
one this leader created), so a deposed leader's writes fail in etcd itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aetcd import rpc

from pegaflow.errors import PegaError
from pegaflow.etcd import DELETE, PUT, EtcdClient, put_op
from pegaflow.etcd_lease import KeptLease
from pegaflow.lifecycle import Backoff, Supervised

log = logging.getLogger(__name__)


class Election:
    """One candidate for the leadership of ``key`` (see the module docstring).

    ``identity`` is written as the key's value (``leader_id`` for everyone);
    ``ttl`` is the lease TTL in seconds.  Start with :meth:`start`, stop with
    :meth:`close` (which resigns).  Never raises for an etcd outage: it retries with
    backoff and is simply not leader meanwhile.
    """

    def __init__(self, client: EtcdClient, key: bytes, identity: str, ttl: int) -> None:
        self.client = client
        self.key = key
        self.identity = identity
        self.ttl = max(1, int(ttl))
        self._backoff = Backoff(0.05)
        self._loop = Supervised(
            "election", self._round, on_error=self._round_failed, backoff=self._backoff
        )
        self._lease: KeptLease | None = None
        self._leader = False
        self._changed = asyncio.Event()
        #: The key's create revision while this candidate leads (the fencing token).
        self.create_revision = 0
        #: Identity of the leader as last seen ("" when none is known).
        self.leader_id = ""
        #: Times this candidate became leader.
        self.terms = 0
        #: Failed etcd calls (the loop retries them).
        self.errors = 0

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Start campaigning in the background."""
        self._loop.start()

    async def close(self, timeout: float = 2.0) -> None:
        """Stop campaigning; a leader resigns (its lease is revoked, so another
        candidate takes over at once)."""
        await self._loop.close()
        await self._resign(timeout)

    # -- state ------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Whether this candidate leads now (False once its lease may have expired)."""
        return self._leader and self._lease is not None and self._lease.left() > 0

    async def wait_leader(self) -> None:
        """Return once this candidate leads."""
        while not self.is_leader:
            self._changed.clear()
            if self.is_leader:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 1.0)

    def fence(self) -> rpc.Compare:
        """A transaction compare that holds only while this candidate still leads: the
        election key's create revision is the one this candidate's campaign created."""
        return rpc.Compare(
            key=self.key,
            target=rpc.Compare.CompareTarget.CREATE,
            result=rpc.Compare.EQUAL,
            create_revision=self.create_revision,
        )

    def status(self) -> dict[str, Any]:
        """The election's state for status pages."""
        return {
            "key": self.key.decode(errors="replace"),
            "leader": self.is_leader,
            "leader_id": self.identity if self.is_leader else self.leader_id,
            "terms": self.terms,
            "ttl_s": self.ttl,
            "errors": self.errors,
        }

    def _set_leader(self, leader: bool) -> None:
        if leader != self._leader:
            self._leader = leader
            self._changed.set()

    # -- loop -------------------------------------------------------------------------

    async def _round(self) -> bool:
        """Campaign when the key is free (and hold it while won), else follow the
        leader's key until it goes; the loop pauses (by the backoff) after a follow."""
        try:
            kv, revision = await self._read()
            if kv is None:
                if await self._campaign():
                    self._backoff.reset()
                    await self._hold()
                    log.warning("lost the leadership of %s", self.key.decode())
                    await self._resign()
                return True
            self._backoff.reset()
            self.leader_id = kv.value.decode(errors="replace")
            await self._follow(revision)
        except Exception:
            await self._resign()
            raise
        return False

    def _round_failed(self, e: Exception) -> None:
        self.errors += 1
        if not isinstance(e, PegaError):
            log.exception("election %s failed; retrying", self.key)
        elif self._backoff.failures == 0:
            log.warning("election %s: etcd call failed (%s); retrying", self.key, e)

    async def _read(self) -> tuple[rpc.KeyValue | None, int]:
        """The election key (or None) and the revision it was read at."""
        r = await self.client.call(lambda s: s.kv.Range, rpc.RangeRequest(key=self.key))
        return (r.kvs[0] if r.kvs else None), r.header.revision

    async def _campaign(self) -> bool:
        """Try to create the key under a fresh lease; True when this candidate won."""
        lease = await KeptLease.grant(self.client, self.ttl)
        try:
            r = await self.client.txn(
                [put_op(self.key, self.identity.encode(), lease.id)],
                compare=[
                    rpc.Compare(
                        key=self.key,
                        target=rpc.Compare.CompareTarget.CREATE,
                        result=rpc.Compare.EQUAL,
                        create_revision=0,
                    )
                ],
            )
        except BaseException:
            with contextlib.suppress(PegaError):
                await lease.revoke()
            raise
        if not r.succeeded:
            with contextlib.suppress(PegaError):
                await lease.revoke()
            return False
        self._lease = lease
        self.create_revision = r.header.revision
        self.leader_id = self.identity
        self.terms += 1
        self._set_leader(True)
        log.info("became leader of %s (term %d)", self.key.decode(), self.terms)
        return True

    async def _hold(self) -> None:
        """Keep the lease alive while leading; return when leadership is lost."""
        lease = self._lease
        assert lease is not None
        while True:
            await asyncio.sleep(lease.due_in())
            remaining = lease.left()
            if remaining <= 0:
                return
            try:
                if not await lease.refresh(timeout=remaining):
                    return  # the lease is gone, and the key with it
                kv, _ = await self._read()
            except PegaError as e:
                self.errors += 1
                log.warning("leader of %s: keep-alive failed (%s)", self.key.decode(), e)
                lease.retry_soon()
                continue
            if kv is None or kv.create_revision != self.create_revision:
                return  # deleted or replaced (by an operator?)

    async def _resign(self, timeout: float | None = None) -> None:
        lease, self._lease = self._lease, None
        self._set_leader(False)
        if lease is not None:
            with contextlib.suppress(PegaError):
                await lease.revoke(timeout=timeout)

    async def _follow(self, revision: int) -> None:
        """Watch the key from ``revision + 1`` until it is deleted (at most ``ttl``
        seconds, after which the caller reads it again: a silent watch cannot stall
        the takeover)."""
        watch = await self.client.watch(self.key, revision + 1, progress_notify=False)
        try:
            async with asyncio.timeout(self.ttl):
                async for r in watch.responses():
                    for ev in r.events:
                        if ev.kv.key != self.key:
                            continue
                        if ev.type == DELETE:
                            return
                        if ev.type == PUT:
                            self.leader_id = ev.kv.value.decode(errors="replace")
        except TimeoutError:
            return
        finally:
            watch.cancel()
