"""The scheduler's half of the prefill/decode handoff (:mod:`~pegaflow.connector.handoff` is the
format).

A ``kv_consumer`` reads the producer's :class:`~pegaflow.connector.handoff.Handoff` from a request's
``kv_transfer_params``, checks it against its own prompt, and waits (a lookup every
:data:`~pegaflow.connector.handoff.POLL_S`, up to ``handoff_wait_s``) until the handed-off blocks
are stored, serving the other requests meanwhile.  A ``kv_producer`` builds the handoff of
a finished request from the prompt blocks it saved.

Pure module: no vLLM import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pegaflow.errors import BadRequest, PegaError

from ..discovery import LocalNodeFinder
from ..handoff import POLL_S, Handoff
from ..metrics import Counters
from ..namespace import block_hash_bytes
from ..settings import ConnectorSettings
from .locating import Locator
from .lookups import Lookups
from .reqstate import Lookup, ReqState

logger = logging.getLogger("pegaflow.connector")

WARN_EVERY_S = 10.0
"""least time between two warnings of unusable handoffs"""


@dataclass(eq=False, repr=False)
class HandoffWait:
    """Reads, checks and waits for handoffs; builds a producer's.

    Args:
        settings: connector settings.
        block_size: tokens per vLLM block.
        counters: the counters to update.
        lookups: the lookups a consumer polls with.
        locator: unpins what a poll located but will not load yet.
        finder: this host's node (named in a producer's handoff).
    """

    settings: ConnectorSettings
    block_size: int
    counters: Counters
    lookups: Lookups
    locator: Locator
    finder: LocalNodeFinder
    _last_warn: float = field(default=-1e9, init=False)

    def read(self, st: ReqState, ns: str, hashes: Sequence[Any], now: float) -> Handoff | None:
        """The producer's handoff in the request's ``kv_transfer_params`` that it still
        waits for; read and checked on first use (an unusable one: a warning, None)."""
        if st.handoff_read:
            return st.handoff
        st.handoff_read = True
        rid = st.request.request_id
        try:
            ho = Handoff.from_params(getattr(st.request, "kv_transfer_params", None))
            if ho is None:
                return None
            if ho.namespace != ns:
                raise BadRequest(
                    f"its namespace {ho.namespace} is not this engine's {ns} (the producer "
                    "runs another model or cache configuration)"
                )
            if ho.blocks > len(hashes) or block_hash_bytes(hashes[ho.blocks - 1]) != ho.last_hash:
                raise BadRequest("its blocks are not this prompt's (the prompt differs)")
            if ho.expired(int(time.time() * 1000)):
                raise BadRequest(f"it expired at {ho.expires_ms} ms (unix time)")
        except PegaError as e:
            self.counters.add("handoff_rejected")
            if now - self._last_warn >= WARN_EVERY_S:
                self._last_warn = now
                logger.warning(
                    "PegaFlow: the handoff (kv_transfer_params) of %s is unusable: %s: %s; "
                    "recomputing what the cluster does not hold. The producer and consumer "
                    "must run the same model and settings, and the proxy must pass the "
                    "producer's kv_transfer_params unchanged (at most one warning per 10 s)",
                    rid, type(e).__name__, e,
                )  # fmt: skip
            return None
        self.counters.add("handoffs")
        st.handoff = ho
        st.handoff_until = now + self.settings.handoff_wait_s
        return ho

    def wait(
        self,
        st: ReqState,
        ho: Handoff,
        ns: str,
        hashes: Sequence[Any],
        start: int,
        now: float,
    ) -> tuple[Lookup | None, bool]:
        """Look up a handed-off request's blocks: ``(lookup, False)`` once all are stored
        (but the block of the prompt's last token, which vLLM computes anyway), once
        ``handoff_wait_s`` is over, or when the cluster cannot answer (``None``: the
        lookups' breaker opened; a single failed lookup is tried again); else
        ``(None, True)``: vLLM asks again in a later step (a new lookup every
        :data:`~pegaflow.connector.handoff.POLL_S`), serving the other requests meanwhile.  The hit
        is claimed whole: the point of the handoff is that the consumer does not prefill."""
        want = min(ho.blocks, (st.request.num_tokens - 1) // self.block_size)
        if now < st.handoff_poll:
            return None, True
        lk = self.lookups.lookup(st, ns, hashes, start, whole=True)
        if lk is None and now < st.handoff_until and self.lookups.breaker.allow():
            st.handoff_poll = now + POLL_S  # one failed lookup (a deadline under load)
            return None, True
        if lk is not None and start + lk.hits < want and now < st.handoff_until:
            if lk.located:  # this poll's locate pinned what it found: not loaded yet
                self.locator.unpin(lk.pins)
            st.lookup = None
            st.handoff_poll = now + POLL_S
            return None, True
        st.handoff = None
        waited = now - (st.handoff_until - self.settings.handoff_wait_s)
        got = start + (lk.hits if lk is not None else 0)
        if got < want:
            self.counters.add("handoff_short")
            logger.info(
                "PegaFlow: %s: %d of the %d blocks handed off by its producer%s were stored "
                "after %.2f s (handoff_wait_s %.2f); computing the rest. Often: the "
                "producer's saves are dropped or slow (its 'PegaFlow cache:' lines).",
                st.request.request_id, got, want, f" (node {ho.node})" if ho.node else "",
                waited, self.settings.handoff_wait_s,
            )  # fmt: skip
        return lk, False

    def params(self, st: ReqState | None, request: Any, ns: str) -> dict[str, Any] | None:
        """A ``kv_producer``'s ``kv_transfer_params`` for a finished request: the
        :class:`~pegaflow.connector.handoff.Handoff` of the prompt blocks it saved or found stored
        (None: not a producer, not tracked, no namespace, or no full block)."""
        if not self.settings.hands_off or st is None or not ns:
            return None
        hashes = request.block_hashes
        n = min(st.next_save, len(hashes))
        if n <= 0:
            return None
        expires_ms = int((time.time() + self.settings.handoff_ttl_s) * 1000)
        ho = Handoff(ns, n, block_hash_bytes(hashes[n - 1]), self.finder.node, expires_ms)
        return ho.to_params()
