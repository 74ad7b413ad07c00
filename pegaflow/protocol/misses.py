"""Why a lookup missed: the causes, one record of a miss, and how it reads in words.

A miss's cause is decided for the *first missing block* of a lookup (the block that
ended the hit; the blocks after it are missed for the same reason as far as anyone can
tell).  The coordinator decides what its index knows (:mod:`pegaflow.coordinator.
evictions`): never stored, evicted (tier, seconds from its save to its eviction),
stored under another namespace of the same model, or on a node that left or that
clients reported unreachable.  The connector decides what only it knows: its cost
model declined the hit, its workers found the node down, the lookup itself failed, its
own save of the block was dropped or refused by a quota.

On the wire a ``lookup`` reply that missed carries ``miss`` (:meth:`MissInfo.to_wire`):
an optional field, absent from older coordinators (the connector then counts
``unknown``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pegaflow.errors import QuotaExceeded

MAX_TEXT = 256
"""characters of a miss record's text fields (namespace, node, reason)"""
MAX_FACTORS = 16
"""factor names of one namespace mismatch"""


class MissCause(enum.StrEnum):
    """Why the first missing block of a lookup was not a hit."""

    NEVER_STORED = "never_stored"
    """no save of it reached the cluster (a new prompt)"""
    EVICTED = "evicted"
    """stored, then evicted (:attr:`MissInfo.tier`, :attr:`MissInfo.saved_s`)"""
    NAMESPACE_MISMATCH = "namespace_mismatch"
    """stored under another namespace of the same model (:attr:`MissInfo.factors`)"""
    NODE_UNREACHABLE = "node_unreachable"
    """stored on a node that left, or that clients cannot reach (:attr:`MissInfo.node`)"""
    LOOKUP_FAILED = "lookup_failed"
    """the lookup failed or timed out (or was skipped while lookups fail)"""
    DECLINED = "declined"
    """a hit the cost model declined: computing it was expected to be faster"""
    QUOTA = "quota"
    """this engine's save of it was refused by a node's quota"""
    SAVE_DROPPED = "save_dropped"
    """this engine's save of it was dropped (:attr:`MissInfo.reason`)"""
    UNKNOWN = "unknown"
    """the coordinator did not say (an older one)"""


@dataclass(frozen=True, slots=True)
class MissInfo:
    """The cause of one lookup's first miss, with what is known of it."""

    cause: MissCause
    tier: str = ""
    """evicted: the tier it was evicted from (``memory`` or ``disk``)"""
    saved_s: float | None = None
    """evicted: seconds from its save to its eviction (None: save not seen)"""
    ns: str = ""
    """namespace mismatch: the namespace that holds it"""
    factors: list[str] = field(default_factory=list)
    """namespace mismatch: the factors that differ (empty: not known)"""
    node: str = ""
    """node unreachable: the node that holds it"""
    reason: str = ""
    """save dropped, quota: why"""

    def to_wire(self) -> dict[str, Any]:
        """The reply's ``miss`` map (empty fields left out)."""
        out: dict[str, Any] = {"cause": self.cause.value}
        if self.tier:
            out["tier"] = self.tier
        if self.saved_s is not None:
            out["saved_s"] = round(self.saved_s, 3)
        for k in ("ns", "node", "reason"):
            if getattr(self, k):
                out[k] = getattr(self, k)
        if self.factors:
            out["factors"] = self.factors
        return out

    @classmethod
    def from_wire(cls, d: Any) -> MissInfo:
        """A reply's ``miss`` map; anything malformed reads as :attr:`MissCause.UNKNOWN`."""
        if not isinstance(d, Mapping):
            return cls(MissCause.UNKNOWN)
        try:
            cause = MissCause(d.get("cause"))
        except ValueError:
            return cls(MissCause.UNKNOWN)
        saved = d.get("saved_s")
        factors = d.get("factors")
        return cls(
            cause,
            _text(d.get("tier")),
            float(saved) if isinstance(saved, int | float) and saved >= 0 else None,
            _text(d.get("ns")),
            [_text(f) for f in factors[:MAX_FACTORS]] if isinstance(factors, list) else [],
            _text(d.get("node")),
            _text(d.get("reason")),
        )

    def detail(self) -> str:
        """What is known beyond the cause, in words ('' when nothing)."""
        c = self.cause
        if c is MissCause.EVICTED:
            after = f", {self.saved_s:.0f} s after save" if self.saved_s is not None else ""
            return f"{self.tier or '?'}{after}"
        if c is MissCause.NAMESPACE_MISMATCH:
            differ = f"differs in {', '.join(self.factors)}" if self.factors else ""
            return "; ".join(x for x in (f"stored under {self.ns}" if self.ns else "", differ) if x)
        if c is MissCause.NODE_UNREACHABLE:
            return self.node
        return self.reason


NEVER_STORED = MissInfo(MissCause.NEVER_STORED)
"""the answer for a block never stored (the common one: its packed form is made once)"""


def _text(v: Any) -> str:
    return v[:MAX_TEXT] if isinstance(v, str) else ""


def differences(mine: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """``name (mine here, theirs there)`` for every factor whose values differ."""
    out = []
    for k in sorted(set(mine) | set(theirs)):
        a, b = mine.get(k, "?"), theirs.get(k, "?")
        if a != b:
            out.append(f"{k} ({a} here, {b} there)")
    return out


QUOTA_PREFIX = "quota: "
"""how the reason of a save refused by a quota starts (:func:`unsaved_reason`)"""


def unsaved_reason(e: BaseException) -> str:
    """The reason a save that raised ``e`` is reported with (:func:`unsaved_cause`)."""
    if isinstance(e, QuotaExceeded):
        return f"{QUOTA_PREFIX}{e}"[:MAX_TEXT]
    return f"{type(e).__name__}: {e}"[:MAX_TEXT]


def unsaved_cause(reason: str) -> MissCause:
    """The cause of a miss of a block whose save went unsaved for ``reason``."""
    return MissCause.QUOTA if reason.startswith(QUOTA_PREFIX) else MissCause.SAVE_DROPPED


def shares(by: Mapping[str, float], details: Mapping[str, str] | None = None) -> str:
    """``never stored 80%, evicted 20% (memory, 42 s after save)``: each cause's share of
    the blocks ``by`` cause, largest first, with a cause's detail from ``details`` in
    brackets ('' when nothing missed)."""
    by = {k: v for k, v in by.items() if v > 0}
    total = sum(by.values())
    parts = []
    for cause, n in sorted(by.items(), key=lambda kv: -kv[1]):
        detail = (details or {}).get(cause)
        share = f"{cause.replace('_', ' ')} {100.0 * n / total:.0f}%"
        parts.append(f"{share} ({detail})" if detail else share)
    return ", ".join(parts)
