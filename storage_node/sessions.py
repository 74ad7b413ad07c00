"""Who asks the node's block service, and how much each may hold: sessions and quotas.

A :class:`Session` is one UCX connection, or one session of the same-host control
socket.  A reservation belongs to the session that made it, and a read pin too (the
rules are those of :mod:`~pegaflow.storage_node.puts` and
:mod:`~pegaflow.storage_node.reads`).  Bytes reserved (not yet committed or aborted) are
bounded per session by ``[node] conn_quota_share`` of the pool and, over all of a
tenant's sessions, by ``tenant_quota_share``; a tenant's read pins are bounded the same
way by the bytes of the distinct blocks they hold.  A block is charged what it takes of
the pool, its slot (its size rounded up to the slot alignment, :func:`charge`), not the
bytes asked: 1-byte blocks take 4 KiB slots each.  A session that holds no reservation
may always reserve one block, whatever the connection bound (a block bigger than
``conn_quota_share`` of a small pool is stored, evicting, as long as it fits the pool);
a batch of several stays within the bound, so that no connection's reservations,
which may never be committed, can evict what the rest of the pool holds.  The tenant
bound has no such exception.  A request past a bound gets ``quota``
(:class:`~pegaflow.errors.QuotaExceeded`) and holds nothing.

A reservation whose payloads come over a transport carries that transport's
:class:`Inflow` (from its session's :attr:`Session.receive`): the service waits on it
before it verifies, and asks it, when the reservation is dropped early, to give the
transport up and to say, slot by slot, when no payload can land there any more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pegaflow.storage_node.blocks import Entry, align_up
from pegaflow.storage_node.metrics import NodeMetrics
from pegaflow.storage_node.pool import BlockPool

from pegaflow.config import NodeConfig
from pegaflow.errors import QuotaExceeded
from pegaflow.protocol.node import Key


def charge(size: int) -> int:
    """What a block of ``size`` bytes is charged to quotas: the slot it takes."""
    return align_up(size)


class Inflow(Protocol):
    """A reservation's payloads arriving over a transport into its slots."""

    done: asyncio.Future[None]
    """every payload landed (an exception: some never will)"""

    def cut(self) -> None:
        """Give the transport up: the payloads will not be waited for, and those it can
        still stop (receives no sender matched yet) are stopped."""

    def landing(self) -> list[int]:
        """The indices of the slots a payload may still land in."""

    def when_landed(self, index: int, then: Callable[[], None]) -> None:
        """Call ``then()`` once no payload can land in slot ``index`` any more."""


Receive = Callable[[int, list[tuple[int, Any]]], Inflow]
"""A transport's receiving of reservation ``seq``'s payloads into ``(index, slot view)``."""


@dataclass(eq=False)
class Usage:
    """What one session, or one tenant over all its sessions, holds on the node."""

    reserved: int = 0
    """bytes (slots, :func:`charge`) of its reservations not yet committed or aborted"""
    pinned: int = 0
    """bytes (slots) of the distinct blocks its read pins hold (counted for tenants only)"""
    pins: dict[Entry, int] = field(default_factory=dict)
    """per pinned entry, how many of its pins hold it"""


@dataclass(eq=False)
class Pin:
    entries: list[Entry]
    timer: asyncio.TimerHandle
    owner: Session


class PinTable(dict[int, Pin]):
    """The read pins taken on one site's loop (their expiry timers run there)."""


@dataclass(eq=False)
class Session:
    """Who asks: one UCX connection or one session of the control socket.  Its
    reservations and read pins are its own."""

    pins: PinTable
    """the pin table of the loop its site serves it on"""
    receive: Receive | None = None
    """how payloads of its reservations reach the slots; None: same-host writes only"""
    tenant: str | None = None
    """None: cluster-wide access"""
    use: Usage = field(default_factory=Usage)
    tenant_use: Usage | None = None
    """the tenant's usage over all its sessions (None: cluster-wide access)"""
    gone: bool = False
    """it ended"""


Handler = Callable[[dict[str, Any], Session], Any]
"""An op's handler: its reply for a session's request, or an awaitable of it."""


class Quotas:
    """The bounds on what sessions and tenants hold, and the counting against them."""

    def __init__(self, cfg: NodeConfig, pool: BlockPool, metrics: NodeMetrics) -> None:
        for name in ("conn_quota_share", "tenant_quota_share"):
            share = getattr(cfg, name)
            if not 0 < share <= 1:
                raise ValueError(f"[node] {name} must be in (0, 1], not {share}")
        self._pool = pool
        self._metrics = metrics
        self._session_quota = int(cfg.conn_quota_share * pool.capacity)
        self._tenant_quota = int(cfg.tenant_quota_share * pool.capacity)
        self._tenant_use: dict[str, Usage] = {}

    def admit(self, session: Session, tenant: str | None) -> None:
        """``session`` authenticated as ``tenant`` (None: cluster-wide access)."""
        session.tenant = tenant
        if tenant is not None:
            session.tenant_use = self._tenant_use.setdefault(tenant, Usage())

    def of(self, s: Session) -> list[tuple[Usage, int, str]]:
        """(usage, bound, scope) of each quota ``s`` is under."""
        out = [(s.use, self._session_quota, "connection")]
        if s.tenant_use is not None:
            out.append((s.tenant_use, self._tenant_quota, "tenant"))
        return out

    def _refuse(self, kind: str, scope: str, s: Session, held: int, more: int) -> None:
        self._metrics.quota_refusals.labels(kind=kind, scope=scope).inc()
        bound, setting = (
            (self._session_quota, "conn_quota_share")
            if scope == "connection"
            else (self._tenant_quota, "tenant_quota_share")
        )
        who = "this connection" if scope == "connection" else f"tenant {s.tenant!r}"
        raise QuotaExceeded(
            f"{more} more bytes {kind} would take {who} past its quota ({held} of {bound} "
            f"bytes held; [node] {setting}); commit, abort or unpin what it holds first"
        )

    def check_reserve(self, s: Session, parsed: list[tuple[Key, int]]) -> None:
        """Refuse a reservation of ``parsed`` blocks that would take ``s`` past a quota
        (blocks stored already reserve nothing and are not counted)."""
        quotas = self.of(s)
        upper = sum(charge(size) for _, size in parsed)
        if all(use.reserved + upper <= bound for use, bound, _ in quotas):
            return
        need = sum(charge(size) for key, size in parsed if not self._pool.contains(key))
        for use, bound, scope in quotas:
            if scope == "connection" and not use.reserved and len(parsed) == 1:
                continue  # one block, none held: bounded by the pool alone
            if use.reserved + need > bound:
                self._refuse("reserved", scope, s, use.reserved, need)

    def reserved(self, s: Session, nbytes: int) -> None:
        """Count ``nbytes`` more reserved by ``s`` (less, if negative)."""
        for use, _, _ in self.of(s):
            use.reserved += nbytes

    def charge_pins(self, s: Session, entries: list[Entry]) -> None:
        """Count a tenant's new pin on ``entries`` (the bytes of distinct blocks), or
        refuse it past a quota."""
        quotas = self.of(s)
        distinct = set(entries)
        for use, bound, scope in quotas:
            more = sum(e.stride for e in distinct if e not in use.pins)
            if use.pinned + more > bound:
                self._refuse("pinned", scope, s, use.pinned, more)
        for use, _, _ in quotas:
            counts = use.pins
            for e in entries:
                n = counts.get(e, 0)
                if not n:
                    use.pinned += e.stride
                counts[e] = n + 1

    def uncharge_pins(self, s: Session, entries: list[Entry]) -> None:
        """A tenant's pin on ``entries`` was released."""
        for use, _, _ in self.of(s):
            counts = use.pins
            for e in entries:
                n = counts.pop(e) - 1
                if n:
                    counts[e] = n
                else:
                    use.pinned -= e.stride
