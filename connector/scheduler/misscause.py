"""Why a lookup missed, as this engine counts it: the cause of each lookup's first miss.

A lookup's hit ends at its first missing block; every block from there on is computed
by vLLM.  Each lookup that leaves blocks to compute is counted once in
``miss_lookups.<cause>`` and its computed blocks in ``miss_blocks.<cause>``
(:data:`~pegaflow.connector.metrics.LABELLED`: ``vllm:pegaflow_miss_lookups_total`` and
``vllm:pegaflow_miss_blocks_total`` with a ``cause`` label), the cause being that of
the first missing block (:class:`~pegaflow.protocol.misses.MissCause`):

* the lookup failed, or was skipped while lookups fail: ``lookup_failed``;
* the cost model declined the block (the hit went on past it): ``declined``;
* its node failed this engine's loads and has not answered since: ``node_unreachable``;
* else what the coordinator said of it (never stored, evicted, namespace mismatch, node
  unreachable; ``unknown`` from an older coordinator), except that a block the
  coordinator never saw stored whose save by this engine was dropped or refused
  (:meth:`MissTally.note_unsaved`, from the workers' reports; the last
  :data:`MAX_UNSAVED` kept) counts as ``save_dropped`` or ``quota``, and one of an
  engine that has had no hit while its model is stored under another namespace
  (:mod:`.nsdiag`) as ``namespace_mismatch``.

Blocks, not tokens: lookups are made of blocks (a block is ``block_size`` tokens), as
``lookup_hit_blocks`` and ``lookup_miss_blocks`` are.  The ``PegaFlow cache:`` line says
the causes' shares of the missed blocks with the last detail seen of each
(:meth:`MissTally.details`).

Pure module: no vLLM import.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from pegaflow.protocol.misses import MissCause, MissInfo, unsaved_cause

from ..metrics import Counters

MAX_UNSAVED = 65536
"""hashes kept of this engine's unsaved blocks (least recent dropped first)"""


def decide(
    asked: int, found: int, reachable: int, claimed: int, said: MissInfo | None,
    unsaved: str | None = None, down: str = "", mismatch: MissInfo | None = None,
) -> MissInfo | None:
    """The cause of a lookup's first miss (None: nothing missed).

    Args:
        asked: blocks looked up.
        found: blocks the cluster holds (the coordinator's, or the local node's, hits).
        reachable: of those, before the first on a node known down.
        claimed: of those, what the cost model kept (loaded).
        said: the coordinator's cause of the miss at ``found`` (None: not said).
        unsaved: why this engine's save of the block at ``found`` did not happen
            (None: it did, or not known).
        down: the node known down that ended the hit at ``reachable``.
        mismatch: the model is stored under another namespace and this engine has had
            no hit yet (:attr:`~.nsdiag.NamespaceCheck.mismatch`): the cause of a miss of
            a block never stored.
    """
    if claimed >= asked:
        return None
    if claimed < reachable:
        return MissInfo(MissCause.DECLINED)
    if reachable < found:
        return MissInfo(MissCause.NODE_UNREACHABLE, node=down)
    info = said if said is not None else MissInfo(MissCause.UNKNOWN)
    if unsaved is not None and info.cause in (MissCause.NEVER_STORED, MissCause.UNKNOWN):
        return MissInfo(unsaved_cause(unsaved), reason=unsaved)
    if mismatch is not None and info.cause is MissCause.NEVER_STORED:
        return mismatch
    return info


class MissTally:
    """Counts each lookup's misses by cause, and keeps what the line says of them.

    Args:
        counters: the scheduler's counters.
    """

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self._lock = threading.Lock()
        self._unsaved: OrderedDict[bytes, str] = OrderedDict()
        self._details: dict[str, str] = {}

    def note_unsaved(self, unsaved: Mapping[str, Sequence[bytes]]) -> None:
        """The workers did not save these blocks (reason -> hashes)."""
        kept = self._unsaved
        with self._lock:
            for reason, hashes in unsaved.items():
                for h in hashes:
                    kept[h] = reason
                    kept.move_to_end(h)
            while len(kept) > MAX_UNSAVED:
                kept.popitem(last=False)

    def unsaved(self, block_hash: bytes) -> str | None:
        """Why this engine's save of the block did not happen (None: not known)."""
        with self._lock:
            return self._unsaved.get(block_hash)

    def count(self, info: MissInfo | None, missed: int) -> None:
        """Count a lookup that left ``missed`` blocks to compute, for ``info``'s cause."""
        if info is None or missed <= 0:
            return
        cause = info.cause.value
        self.counters.add(f"miss_lookups.{cause}")
        self.counters.add(f"miss_blocks.{cause}", missed)
        detail = info.detail()
        if detail:
            with self._lock:
                self._details[cause] = detail

    def failed(self, asked: int) -> None:
        """Count a lookup that failed or was skipped (all ``asked`` blocks computed)."""
        self.count(MissInfo(MissCause.LOOKUP_FAILED), asked)

    def details(self) -> dict[str, str]:
        """The last detail seen of each cause (e.g. ``memory, 42 s after save``)."""
        with self._lock:
            return dict(self._details)
