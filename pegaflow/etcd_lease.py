"""A lease its holder keeps alive (:class:`KeptLease`), and how long it surely lives."""

from __future__ import annotations

import time

from pegaflow.deadline import Timeout
from pegaflow.errors import PegaError
from pegaflow.etcd import EtcdClient


class KeptLease:
    """A lease its holder keeps alive with a keep-alive every ``interval_s`` (a third of
    its TTL by default), and the time until which it is surely alive.

    Make one with :meth:`grant`.  :attr:`valid_until` is the send time of the last
    successful keep-alive (or of the grant) plus the TTL etcd granted then: etcd cannot
    expire the lease before it.  A failed keep-alive is retried after
    ``max(min_retry_s, min(interval_s, time left / 3))``.
    """

    def __init__(
        self,
        client: EtcdClient,
        lease_id: int,
        ttl: int,
        sent: float,
        *,
        interval_s: float | None = None,
        min_retry_s: float = 0.05,
    ) -> None:
        self.client = client
        #: The lease's id.
        self.id = lease_id
        self.ttl = ttl
        self.interval_s = ttl / 3 if interval_s is None else interval_s
        self.min_retry_s = min_retry_s
        #: Monotonic time until which etcd keeps the lease for sure.
        self.valid_until = sent + ttl
        #: Monotonic time the next keep-alive is due.
        self.next_due = time.monotonic() + self.interval_s

    @classmethod
    async def grant(
        cls,
        client: EtcdClient,
        ttl: int,
        *,
        interval_s: float | None = None,
        min_retry_s: float = 0.05,
        timeout: Timeout = None,
    ) -> KeptLease:
        """Grant a lease of ``ttl`` seconds (raises PegaError when etcd cannot)."""
        sent = time.monotonic()
        lease_id = await client.grant(ttl, timeout=timeout)
        return cls(client, lease_id, ttl, sent, interval_s=interval_s, min_retry_s=min_retry_s)

    def left(self) -> float:
        """Seconds the lease surely lives on (<= 0 once it may have expired)."""
        return self.valid_until - time.monotonic()

    def due_in(self) -> float:
        """Seconds until the next keep-alive is due (0 when overdue)."""
        return max(0.0, self.next_due - time.monotonic())

    def retry_soon(self) -> None:
        """Schedule the next keep-alive as after a failed one."""
        now = time.monotonic()
        wait = max(self.min_retry_s, min(self.interval_s, (self.valid_until - now) / 3))
        self.next_due = now + wait

    async def refresh(self, timeout: Timeout = None) -> bool:
        """One keep-alive: True while the lease lives, False once etcd says it is gone.
        A failed call raises PegaError, and the next keep-alive is due soon."""
        sent = time.monotonic()
        try:
            ttl = await self.client.keepalive(self.id, timeout=timeout)
        except PegaError:
            self.retry_soon()
            raise
        self.next_due = time.monotonic() + self.interval_s
        if ttl <= 0:
            return False
        self.valid_until = sent + ttl
        return True

    async def revoke(self, timeout: Timeout = None) -> None:
        """Revoke the lease (its keys are deleted now); raises PegaError."""
        await self.client.revoke(self.id, timeout=timeout)
