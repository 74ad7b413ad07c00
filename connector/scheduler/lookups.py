"""The scheduler's lookups and what it claims of their hits.

One lookup per new request, under a hard deadline and behind a circuit breaker, so a
slow or dead cluster costs the engine at most ``lookup_timeout_s`` per request and
nothing at all while the breaker is open.  With layer-wise loads this host's node is
asked first (:mod:`.locating`); the coordinator only when the node lacks some blocks.
Of a hit the cost model (:mod:`.costmodel`) keeps what loads faster than vLLM computes
it; a remote node declined for want of measurements is probed in the background.
Each lookup that leaves blocks to compute is counted by the cause of its first missing
block (:mod:`.misscause`).

Pure module: no vLLM import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass, replace
from typing import Any

from pegaflow.observability import telemetry

from .. import sameprocess
from ..metadata import LOCAL, LoadJob, disk_source
from ..metrics import Counters
from ..namespace import block_hashes_bytes
from ..policy import CircuitBreaker
from ..report import SameHostReport
from ..settings import ConnectorSettings
from .costmodel import CostModel, Decision
from .known import KnownBlocks
from .locating import Locator
from .misscause import MissTally, decide
from .nsdiag import NamespaceCheck
from .reqstate import Lookup, ReqState
from .schedclient import ClusterClient
from .warmup import WarmUp

logger = logging.getLogger("pegaflow.connector")

_LOCAL_SOURCES = {LOCAL, disk_source(LOCAL)}

REPORTED_DOWN_S = 2.0
"""how long a node the workers reported down has its hits declined, unless reported again"""


@dataclass(eq=False, repr=False)
class Lookups:
    """Looks up a request's blocks and claims what the cost model keeps of the hit.

    Args:
        settings: connector settings.
        world_size: shards per block (a block is a hit only when all are stored).
        counters: the counters to update.
        cluster: the cluster client.
        warm_up: the engine-start connections (an early lookup waits for them).
        locator: same-host locates and pins.
        costs: the cost model.
        known: the known-blocks cache (hits added, misses dropped).
        same_host: the report of lookups answered by the local node alone.
        clock: monotonic clock (tests inject one).
        ns_check: asks, while nothing hits, whether the model is stored under another
            namespace (None: never asks).
    """

    settings: ConnectorSettings
    world_size: int
    counters: Counters
    cluster: ClusterClient
    warm_up: WarmUp
    locator: Locator
    costs: CostModel
    known: KnownBlocks
    same_host: SameHostReport
    clock: InitVar[Callable[[], float]]
    ns_check: NamespaceCheck | None = None

    def __post_init__(self, clock: Callable[[], float]) -> None:
        self.shards = list(range(self.world_size))
        self._clock = clock
        self.breaker = CircuitBreaker.of(self.settings, clock)
        """pauses lookups while they fail"""
        self._pending_probes: list[LoadJob] = []
        self._reported_down: dict[str, float] = {}
        """nodes the workers reported down (:attr:`WorkerReport.down_nodes`), until when"""
        self.misses = MissTally(self.counters)
        """the lookups' misses by cause"""

    def take_probes(self) -> list[LoadJob]:
        """The probe loads planned since the last call (for this step's plan)."""
        probes, self._pending_probes = self._pending_probes, []
        return probes

    def lookup(
        self,
        st: ReqState,
        ns: str,
        hashes: Sequence[Any],
        start: int,
        whole: bool = False,
        locate: bool = True,
    ) -> Lookup | None:
        """Look up ``hashes[start:]`` for ``st``'s request and claim the hit (``whole``:
        all of it, a handoff); also kept as ``st.lookup``.  None when the cluster cannot
        answer (counted; the breaker may pause lookups).  ``locate``: this host's node
        may answer and locate the blocks (off: the coordinator is asked, the workers
        locate what they load)."""
        if not self.breaker.allow():
            self.counters.add("lookup_skipped")
            self.misses.failed(len(hashes) - start)
            return None
        client = self.cluster.get()
        if client is None:
            self.breaker.failure()
            self.counters.add("lookup_errors")
            self.misses.failed(len(hashes) - start)
            return None
        self.warm_up.before_lookup(st.request.request_id)
        asked = block_hashes_bytes(hashes[start:])
        t0 = self._clock()
        timeout = self.settings.lookup_timeout_s
        try:
            with telemetry.span(
                "pegaflow.connector.lookup",
                {"pegaflow.blocks": len(asked)} if telemetry.tracing else None,
                parent=telemetry.request_context(st.request.request_id),
            ):
                located = self.locator.locate(client, ns, asked) if locate else None
                if located is not None:
                    local = self.locator.answer_locally(start, len(hashes), asked, located)
                    if local is not None:  # the coordinator cannot add to a whole hit
                        self.breaker.success()
                        self._account(asked, local.hits, "lookups_local")
                        self.same_host.add(self.locator.local_node, len(asked), local.hits)
                        found = local.hits
                        self.claim(st, asked, local, whole)
                        self.misses.count(decide(len(asked), found, found, local.hits, None),
                                          len(asked) - local.hits)  # fmt: skip
                        self._debug_lookup(st, asked, local, t0, "answered by the local node")
                        st.lookup = local
                        return local
                res = client.lookup_here(ns, asked, self.shards, timeout, generations=True)
            hits = max(0, min(int(res.hits), len(asked)))
            blocks = list(res.blocks or [])
            gens = list(getattr(res, "generations", None) or [])
            on_disk = list(getattr(res, "on_disk", None) or [])
            said = getattr(res, "miss", None)
        except Exception as e:
            self.counters.add("lookup_errors")
            self.misses.failed(len(asked))
            if self.breaker.failure():
                logger.warning("PegaFlow: lookups failing; pausing them (circuit breaker open)")
            self.cluster.log_error("lookup failed", e)
            return None
        finally:
            self.counters.add("lookup_seconds", self._clock() - t0)
        self.breaker.success()
        hits = self._valid_rows(blocks, hits)
        self._account(asked, hits, "lookups")
        if self.ns_check is not None:
            self.ns_check.after_lookup(client, ns, hits)
        lk = Lookup(self._clock(), start, len(hashes), hits, [list(b) for b in blocks[:hits]])
        if len(gens) >= hits and all(
            isinstance(g, list | tuple) and len(g) == self.world_size for g in gens[:hits]
        ):
            lk.gens = [list(g) for g in gens[:hits]]
        if any(on_disk[:hits]):
            lk.disk = [d is True for d in on_disk[:hits]]
            if located is not None:  # the locate promoted the local node's blocks
                local = self.locator.local_node
                lk.disk = [
                    d and local not in row for d, row in zip(lk.disk, lk.nodes, strict=False)
                ]
        down = self._skip_unreachable(client, lk)
        reachable = lk.hits
        self.claim(st, asked, lk, whole)
        unsaved = self.misses.unsaved(asked[hits]) if hits < len(asked) else None
        mismatch = self.ns_check.mismatch if self.ns_check is not None else None
        info = decide(len(asked), hits, reachable, lk.hits, said, unsaved, down, mismatch)
        self.misses.count(info, len(asked) - lk.hits)
        if located is not None:
            self.locator.keep_located(lk, located)
        self._debug_lookup(st, asked, lk, t0, "coordinator")
        if lk.hits and self.settings.read_pin_s > 0 and not lk.located:
            self.locator.pin(client, ns, asked[: lk.hits], lk.nodes)
        st.lookup = lk
        return lk

    def lookup_all(self, ns: str, keys: list[bytes]) -> Lookup | None:
        """Whether every one of ``keys`` is stored (every shard): a :class:`Lookup` of
        them all, else None (a miss, or the cluster did not answer: counted)."""
        if not keys:
            return Lookup(self._clock(), 0, 0, 0, [])
        client = self.cluster.get()
        if client is None or not self.breaker.allow():
            return None
        try:
            res = client.lookup_here(
                ns, keys, self.shards, self.settings.lookup_timeout_s, generations=True
            )
        except Exception as e:
            self.counters.add("lookup_errors")
            if self.breaker.failure():
                logger.warning("PegaFlow: lookups failing; pausing them (circuit breaker open)")
            self.cluster.log_error("lookup failed", e)
            return None
        self.breaker.success()
        blocks = list(res.blocks or [])[: len(keys)]
        if self._valid_rows(blocks, min(int(res.hits), len(keys))) < len(keys):
            return None
        self.known.add_many(keys)
        lk = Lookup(self._clock(), 0, len(keys), len(keys), [list(b) for b in blocks])
        gens = list(getattr(res, "generations", None) or [])
        if len(gens) >= len(keys):
            lk.gens = [list(g) for g in gens[: len(keys)]]
        on_disk = list(getattr(res, "on_disk", None) or [])
        if any(on_disk[: len(keys)]):
            lk.disk = [d is True for d in on_disk[: len(keys)]]
        return lk

    def _valid_rows(self, blocks: list[Any], hits: int) -> int:
        """How many of the first ``hits`` answered blocks name a node for every shard:
        the answer is trusted no further."""
        valid = 0
        for b in blocks[:hits]:
            if not isinstance(b, list | tuple) or len(b) != self.world_size:
                break
            if not all(isinstance(x, str) and x for x in b):
                break
            valid += 1
        return valid

    def note_down(self, nodes: Sequence[str]) -> None:
        """The workers' clients know ``nodes`` to be down now: their hits are declined
        for :data:`REPORTED_DOWN_S` (each step's report renews it while they are)."""
        until = self._clock() + REPORTED_DOWN_S
        for n in nodes:
            self._reported_down[n] = until

    def _skip_unreachable(self, client: Any, lk: Lookup) -> str:
        """End the hit before its first block on a node that failed this engine's loads
        and has not answered since (:mod:`pegaflow.client.nodehealth`: the worker's
        client, when it shares this process, and this one's; the workers' reports
        otherwise): its load would fail, so those blocks are computed at once (counted;
        vLLM would otherwise look the request up again after each failed load, and claim
        the same hit again while the coordinators still name the node).  Returns the node
        the hit ended at ('' when none)."""
        if lk.hits <= 0:
            return ""
        down: set[str] = set()
        if self._reported_down:
            now = self._clock()
            self._reported_down = {n: t for n, t in self._reported_down.items() if t > now}
            down.update(self._reported_down)
        worker = sameprocess.worker()
        for c in (client, worker.client if worker is not None else None):
            if c is not None:
                down |= c.health.down()
        if not down:
            return ""
        cut = next((i for i, row in enumerate(lk.nodes) if not down.isdisjoint(row)), lk.hits)
        if cut >= lk.hits:
            return ""
        node = next(n for n in lk.nodes[cut] if n in down)
        self.counters.add("unreachable_declined_blocks", lk.hits - cut)
        lk.hits = cut
        lk.nodes = lk.nodes[:cut]
        lk.gens = lk.gens[:cut]
        lk.disk = lk.disk[:cut]
        return node

    def sources(self, lk: Lookup) -> list[str]:
        """Per hit block, where it loads from: :data:`LOCAL` when every shard is on this
        host's node and the same-host path is on, else the (first) other node; its
        :func:`~.costmodel.disk_source` when the block is only on a disk tier."""
        local = self.locator.local_node if self.settings.same_host_shortcut else ""
        out = []
        disk = lk.disk
        for i, row in enumerate(lk.nodes):
            far = [n for n in row if n != local]
            src = far[0] if far else LOCAL
            out.append(disk_source(src) if i < len(disk) and disk[i] else src)
        return out

    def claim(self, st: ReqState, asked: list[bytes], lk: Lookup, whole: bool = False) -> None:
        """Keep of the hit only what the cost model expects to load faster than vLLM
        computes it (the whole hit, a leading part, or nothing); count the decision.
        A remote node declined for want of recent measurements is probed.  ``whole``:
        keep it all (a handoff)."""
        if lk.hits <= 0 or not self.costs.enabled or whole:
            return
        sources = self.sources(lk)
        s = self.settings
        d = self.costs.choose(sources, layerwise=s.layerwise and s.same_host_shortcut)
        if (
            d.blocks < lk.hits
            and set(sources) <= _LOCAL_SOURCES
            and self.costs.wants_probe(sources[d.blocks])
        ):
            # this host's pool (and its disk) has no background probe: serving a hit is
            # its measurement
            self.counters.add("probes")
            d = replace(d, blocks=lk.hits, reason="whole")
        if d.reason == "whole":
            self.counters.add("cost_whole")
        else:
            self.counters.add("cost_part" if d.blocks else "cost_declined")
            self.counters.add("cost_declined_blocks", lk.hits - d.blocks)
            self._maybe_probe(asked, lk, sources, d.blocks)
        if logger.isEnabledFor(logging.DEBUG):
            self._debug_claim(st, lk, sources, d)
        if d.blocks < lk.hits:
            lk.hits = d.blocks
            lk.nodes = lk.nodes[: d.blocks]
            lk.gens = lk.gens[: d.blocks]
            lk.disk = lk.disk[: d.blocks]
            if lk.located and not d.blocks:  # nothing to load: let the node unpin now
                self.locator.unpin(lk.pins)
                lk.located, lk.pins = [], []
            lk.located = [where[: d.blocks] for where in lk.located]

    def _maybe_probe(
        self, asked: list[bytes], lk: Lookup, sources: list[str], claimed: int
    ) -> None:
        """Time a declined remote node in the background: fetch a few of its blocks into
        the workers' host memory (no request waits on it)."""
        for src in dict.fromkeys(sources[claimed:]):
            if src in _LOCAL_SOURCES or not self.costs.wants_probe(src):
                continue
            idx = [i for i in range(claimed, lk.hits) if sources[i] == src]
            idx = idx[: self.costs.probe_blocks()]
            self._pending_probes.append(
                LoadJob(
                    req_id=f"pegaflow.probe:{src}",
                    block_ids=[],
                    hashes=[asked[i] for i in idx],
                    nodes=[lk.nodes[i] for i in idx],
                    gens=[lk.gens[i] for i in idx] if len(lk.gens) >= lk.hits else [],
                    disk=[lk.disk[i] for i in idx] if len(lk.disk) >= lk.hits else [],
                    probe=True,
                )
            )
            self.counters.add("probes")

    def _account(self, asked: list[bytes], hits: int, kind: str) -> None:
        self.counters.add(kind)
        self.counters.add("lookup_hit_blocks", hits)
        self.counters.add("lookup_miss_blocks", len(asked) - hits)
        self.known.add_many(asked[:hits])
        self.known.discard_many(asked[hits:])

    def _debug_lookup(
        self, st: ReqState, asked: list[bytes], lk: Lookup, t0: float, how: str
    ) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "PegaFlow: lookup of %d blocks for %s: %d hits (%s, %s) in %.2f ms",
                len(asked), st.request.request_id, lk.hits, how,
                "located" if lk.located else "not located", (self._clock() - t0) * 1e3,
            )  # fmt: skip

    def _debug_claim(self, st: ReqState, lk: Lookup, sources: list[str], d: Decision) -> None:
        kinds = sorted({x for x in sources})
        logger.debug(
            "PegaFlow: %s: claim %d of %d hit blocks (%s; from %s): load %.2f ms against "
            "compute %.2f ms (%s)",
            st.request.request_id, d.blocks, lk.hits, d.reason, ", ".join(kinds),
            d.est_load_s * 1e3, d.est_compute_s * 1e3, self.costs.snapshot(),
        )  # fmt: skip
