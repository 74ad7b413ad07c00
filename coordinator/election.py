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
import time
from typing import Any

from aetcd import rpc

from pegaflow.errors import PegaError
from pegaflow.etcd import DELETE, PUT, EtcdClient, put_op

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 5.0


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
        self._task: asyncio.Task[None] | None = None
        self._lease = 0
        self._leader = False
        self._valid_until = 0.0
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
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="election")

    async def close(self, timeout: float = 2.0) -> None:
        """Stop campaigning; a leader resigns (its lease is revoked, so another
        candidate takes over at once)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        lease, self._lease = self._lease, 0
        self._set_leader(False)
        if lease:
            with contextlib.suppress(PegaError):
                await self.client.revoke(lease, timeout=timeout)

    # -- state ------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Whether this candidate leads now (False once its lease may have expired)."""
        return self._leader and time.monotonic() < self._valid_until

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

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                kv, revision = await self._read()
                if kv is None:
                    if await self._campaign():
                        failures = 0
                        await self._hold()
                        log.warning("lost the leadership of %s", self.key.decode())
                        await self._resign()
                    continue
                failures = 0
                self.leader_id = kv.value.decode(errors="replace")
                await self._follow(revision)
            except asyncio.CancelledError:
                raise
            except PegaError as e:
                self.errors += 1
                if failures == 0:
                    log.warning("election %s: etcd call failed (%s); retrying", self.key, e)
                await self._resign()
            except Exception:
                self.errors += 1
                log.exception("election %s failed; retrying", self.key)
                await self._resign()
            failures += 1
            await asyncio.sleep(min(_MAX_BACKOFF_S, 0.05 * 2 ** min(failures, 10)))

    async def _read(self) -> tuple[rpc.KeyValue | None, int]:
        """The election key (or None) and the revision it was read at."""
        r = await self.client.call(lambda s: s.kv.Range, rpc.RangeRequest(key=self.key))
        return (r.kvs[0] if r.kvs else None), r.header.revision

    async def _campaign(self) -> bool:
        """Try to create the key under a fresh lease; True when this candidate won."""
        t0 = time.monotonic()
        lease = await self.client.grant(self.ttl)
        try:
            r = await self.client.txn(
                [put_op(self.key, self.identity.encode(), lease)],
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
                await self.client.revoke(lease)
            raise
        if not r.succeeded:
            with contextlib.suppress(PegaError):
                await self.client.revoke(lease)
            return False
        self._lease = lease
        self.create_revision = r.header.revision
        self._valid_until = t0 + self.ttl
        self.leader_id = self.identity
        self.terms += 1
        self._set_leader(True)
        log.info("became leader of %s (term %d)", self.key.decode(), self.terms)
        return True

    async def _hold(self) -> None:
        """Keep the lease alive while leading; return when leadership is lost."""
        interval = self.ttl / 3
        while True:
            await asyncio.sleep(interval)
            t0 = time.monotonic()
            remaining = self._valid_until - t0
            if remaining <= 0:
                return
            try:
                ttl = await self.client.keepalive(self._lease, timeout=remaining)
                if ttl <= 0:
                    return  # the lease is gone, and the key with it
                self._valid_until = t0 + ttl
                kv, _ = await self._read()
            except PegaError as e:
                self.errors += 1
                log.warning("leader of %s: keep-alive failed (%s)", self.key.decode(), e)
                interval = max(0.05, min(self.ttl / 3, (self._valid_until - time.monotonic()) / 3))
                continue
            interval = self.ttl / 3
            if kv is None or kv.create_revision != self.create_revision:
                return  # deleted or replaced (by an operator?)

    async def _resign(self) -> None:
        lease, self._lease = self._lease, 0
        self._set_leader(False)
        if lease:
            with contextlib.suppress(PegaError):
                await self.client.revoke(lease)

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
