"""Why an engine gets no hit: the same model stored under another namespace.

Engines whose namespace factors differ (model identity, dtype, KV cache dtype and
layout, block size, layers, heads, TP/PP, hash seed, weights: :mod:`~pegaflow.connector.namespace`)
write disjoint namespaces and never hit each other's blocks.  That is right, and silent: an
operator sees a hit rate of zero and nothing else.  So while an engine has had no hit
at all, a lookup that finds nothing makes it ask the coordinator (at most every
:data:`CHECK_EVERY_S`, in the background: the lookup is not delayed) for the other
namespaces of its model that hold blocks (``namespace_peers``, sending its own factors:
:mod:`pegaflow.coordinator.namespaces`).  If there are some, it logs one WARNING that
names them and the factors in which they differ (as far as their engines sent them to
that coordinator), then stops asking.  Until the engine's first hit, its lookups' misses
of blocks never stored are then counted as ``namespace_mismatch`` (:attr:`NamespaceCheck.
mismatch`): another factor than block size or hash seed keeps a prompt's hashes, and the
coordinator names the namespace holding them itself; those two change every hash, so
only the model's presence elsewhere tells.

Pure module: no vLLM import.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from pegaflow.protocol.misses import MissCause, MissInfo, differences

logger = logging.getLogger("pegaflow.connector")

CHECK_EVERY_S = 60.0
"""least time between two asks while lookups find nothing"""
NOT_FACTORS = frozenset({"label"})
"""fields of the namespace factors that do not key blocks (a readable name)"""


def factor_strings(factors: Mapping[str, Any]) -> dict[str, str]:
    """The factors that key blocks, as strings (what is sent to the coordinator)."""
    return {k: str(v) for k, v in factors.items() if k not in NOT_FACTORS}


def mismatch_line(ns: str, mine: Mapping[str, str], peers: list[dict[str, Any]]) -> str:
    """The WARNING for ``peers`` (``{ns, blocks, factors}``) of namespace ``ns``."""
    parts = []
    for p in peers:
        theirs = p.get("factors") or {}
        diff = differences(mine, theirs) if theirs else []
        if diff:
            why = "it differs in " + ", ".join(diff)
        else:
            why = (
                "its engines did not send their factors to this coordinator: compare the "
                "'PegaFlow namespace ... for model identity' line of their logs with this one's"
            )
        parts.append(f"{p['ns']} ({int(p.get('blocks', 0))} blocks; {why})")
    return (
        f"PegaFlow: namespace mismatch: nothing of this engine's namespace {ns} is stored, "
        f"but the same model is, under {'; '.join(parts)}. Blocks of another namespace are "
        "never this engine's hits; to share them, run the engines with the same settings "
        "for those factors (for 'model': the same model files, model_id or served model name)"
    )


class NamespaceCheck:
    """Asks once in a while, while lookups find nothing (see the module docstring).

    Args:
        factors: this engine's namespace factors (:func:`factor_strings` of them).
        timeout: deadline of the ask.
        clock: monotonic clock.
    """

    def __init__(
        self,
        factors: Callable[[], Mapping[str, str]],
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factors = factors
        self._timeout = timeout
        self._clock = clock
        self._last = -CHECK_EVERY_S
        self._settled = False
        """a hit was seen, or the mismatch was logged: nothing more to ask"""
        self.mismatch: MissInfo | None = None
        """the mismatch logged, while the engine has had no hit (a miss's cause)"""

    def after_lookup(self, client: Any, ns: str, hits: int) -> None:
        """Note a lookup of ``ns`` that found ``hits`` blocks (``client``: the
        scheduler's cluster client)."""
        if hits:
            self._settled, self.mismatch = True, None
            return
        if self._settled:
            return
        now = self._clock()
        if now - self._last < CHECK_EVERY_S:
            return
        self._last = now
        mine = dict(self._factors())
        try:
            fut = client.submit_namespace_peers(ns, mine, timeout=self._timeout)
        except Exception as e:  # a diagnosis must never fail a lookup
            logger.debug("PegaFlow: namespace check not sent: %s", e)
            return
        fut.add_done_callback(lambda f: self._answered(ns, mine, f))

    def _answered(self, ns: str, mine: dict[str, str], fut: concurrent.futures.Future[Any]) -> None:
        try:
            peers = fut.result()
        except Exception as e:  # an old coordinator, a timeout: ask later
            logger.debug("PegaFlow: namespace check failed: %s", e)
            return
        if peers and not self._settled:
            self._settled = True
            p = peers[0]
            differ = differences(mine, p.get("factors") or {}) if p.get("factors") else []
            self.mismatch = MissInfo(MissCause.NAMESPACE_MISMATCH, ns=p["ns"], factors=differ)
            logger.warning("%s", mismatch_line(ns, mine, peers))
