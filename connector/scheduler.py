"""Scheduler side of the connector: lookups, load plans, save plans, delayed frees.

Runs inside vLLM's scheduler (engine-core process).  Everything here is bookkeeping on
block indices and hashes; the only I/O is one lookup RPC per new request, under a hard
deadline and behind a circuit breaker, so a slow or dead cluster costs the engine at
most ``lookup_timeout_s`` per request and nothing at all while the breaker is open.

Pure module: no vLLM import (requests and scheduler outputs are duck-typed), so the
bookkeeping is unit-tested with fakes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from pegaflow import telemetry
from pegaflow.deadline import Deadline
from pegaflow.errors import BadRequest, PegaError
from pegaflow.wire import LocatedBlocks

from .costmodel import LOCAL, CostModel, Decision
from .discovery import LocalNodeFinder
from .handoff import POLL_S, Handoff
from .metadata import LoadJob, SaveJob, StepPlan, WorkerReport
from .metrics import Counters
from .namespace import block_hash_bytes, block_hashes_bytes
from .policy import LOCATE_PIN_S, MAX_LOCATE, WARM_UP_WAIT_S, CircuitBreaker
from .report import SameHostReport
from .settings import ConnectorSettings

logger = logging.getLogger("pegaflow.connector")

WARM_UP_NS = "pegaflow.warm-up"
"""the namespace of the lookups made at engine start (it holds nothing)"""


class LookupClient(Protocol):
    """The part of :class:`pegaflow.client.SyncPegaClient` the scheduler uses."""

    def lookup(
        self,
        ns: str,
        hashes: Sequence[bytes],
        shards: Sequence[int] = (0,),
        timeout: float | None = None,
        generations: bool = False,
    ) -> Any: ...


class KnownBlocks:
    """Bounded LRU set of hashes believed stored in the cluster (saves skip them)."""

    def __init__(self, capacity: int) -> None:
        self._cap = max(1024, capacity)
        self._d: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, h: bytes) -> bool:
        if h in self._d:
            self._d.move_to_end(h)
            return True
        return False

    def __len__(self) -> int:
        return len(self._d)

    def add(self, h: bytes) -> None:
        """Remember ``h`` (most recently used)."""
        self._d[h] = None
        self._d.move_to_end(h)
        while len(self._d) > self._cap:
            self._d.popitem(last=False)

    def discard(self, h: bytes) -> None:
        """Forget ``h``."""
        self._d.pop(h, None)

    def add_many(self, hs: Sequence[bytes]) -> None:
        """Remember each of ``hs`` (those already known keep their place)."""
        d = self._d
        d.update(dict.fromkeys(hs))
        for _ in range(len(d) - self._cap):
            d.popitem(last=False)

    def discard_many(self, hs: Sequence[bytes]) -> None:
        """Forget each of ``hs``."""
        pop = self._d.pop
        for h in hs:
            pop(h, None)


def _on_node(nodes: list[list[str]], node: str, world_size: int) -> bool:
    """Whether every shard of every block lies on ``node``."""
    return nodes.count([node] * world_size) == len(nodes)


@dataclass
class _Lookup:
    at: float
    start: int
    n_hashes: int
    hits: int
    nodes: list[list[str]]
    sync: bool = False
    gens: list[list[int]] = field(default_factory=list)
    """per hit block, the generation of each shard when the lookup saw it (fencing)"""
    located: list[LocatedBlocks] = field(default_factory=list)
    """per shard: where the hit blocks are in the local node's pool file (see
    :attr:`LoadJob.located`); empty when the blocks were not located"""
    pins: list[int] = field(default_factory=list)
    """per shard, the local node's pin on the located blocks"""
    located_at: float = 0.0


@dataclass
class _ReqState:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0
    lookup: _Lookup | None = None
    loading: bool = False
    saved_any: bool = False
    started_ns: int = field(default_factory=time.time_ns)  # root span of its trace
    handoff: Handoff | None = None
    """a producer's handoff this request still waits for (see :meth:`SchedulerSide._await`)"""
    handoff_read: bool = False
    handoff_until: float = 0.0
    handoff_poll: float = 0.0


def _group0(block_ids: Any) -> list[int]:
    """The block ids of the (only) KV cache group from vLLM's per-group tuple."""
    if not block_ids:
        return []
    first = block_ids[0]
    if isinstance(first, list | tuple):
        return list(first)
    return list(block_ids)  # already a flat list (older vLLM)


class SchedulerSide:
    """The scheduler-side state machine of :class:`~pegaflow.connector.PegaKVConnector`.

    Args:
        settings: connector settings.
        block_size: tokens per vLLM block.
        world_size: TP x PP ranks of this engine; a block is a hit only when all of
            its ``world_size`` shards are stored.
        client: lookup client (``None``: created lazily by ``client_factory``).
        namespace: returns the cache namespace (``None``: not known yet, ask again);
            called on first use because it depends on vLLM state initialised after
            the connector.
        counters: the counters to update.
        client_factory: builds the client on first use.
        clock: monotonic clock (tests inject one).
        device: the engine's device type (the cost model's prior depends on it).
        block_bytes: bytes of one block of one shard, as far as the scheduler can tell
            (the workers report the exact figure).
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        block_size: int,
        world_size: int,
        namespace: Callable[[], str | None],
        counters: Counters,
        client: LookupClient | None = None,
        client_factory: Callable[[], LookupClient] | None = None,
        clock: Callable[[], float] = time.monotonic,
        device: str = "cpu",
        block_bytes: int = 0,
    ) -> None:
        self.settings = settings
        self.block_size = block_size
        self.world_size = world_size
        self.shards = list(range(world_size))
        self._namespace_fn = namespace
        self._namespace: str | None = None
        self.counters = counters
        self._client = client
        self._client_factory = client_factory
        self._clock = clock
        self.lookup_breaker = CircuitBreaker(
            settings.failures_to_backoff, settings.backoff_s, settings.backoff_max_s, clock
        )
        self.locate_breaker = CircuitBreaker(
            settings.failures_to_backoff, settings.backoff_s, settings.backoff_max_s, clock
        )
        self.known = KnownBlocks(settings.known_blocks)
        self.finder = LocalNodeFinder(settings.local_node, settings.rpc_timeout_s, announce=True)
        """the storage node on this host (``local_node``, else found at engine start)"""
        self.costs = CostModel(
            device, block_size, block_bytes or 1 << 20, enabled=settings.cost_model
        )
        """what loads from each source and prefills cost: decides what to claim"""
        self._pending_probes: list[LoadJob] = []
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[LoadJob] = []
        self._delay_free: list[str] = []
        self._last_error_log = -1e9
        self._last_handoff_warn = -1e9
        self._client_lock = threading.Lock()
        self._closed = False
        self._connected = threading.Event()
        """clear while :meth:`start_warm_up`'s connections are being made"""
        self._connected.set()
        self.same_host = SameHostReport(self._send_report)
        """the lookups answered by the local node alone, reported to it (no coordinator
        sees them; ``pegaflow status`` counts them in the cluster's hit rate)"""

    # ---- helpers -------------------------------------------------------------------

    @property
    def local_node(self) -> str:
        """The node on this host: ``local_node`` when set, else the one found at engine
        start ('' while none is known)."""
        return self.finder.node

    @property
    def namespace(self) -> str:
        """The cache namespace ('' when it could not be determined: connector inert)."""
        if self._namespace is None:
            try:
                ns = self._namespace_fn()
            except Exception:
                logger.exception("PegaFlow: cannot determine the cache namespace; connector off")
                ns = ""
            if ns is None:  # not determinable yet (vLLM not fully initialised): ask again
                return ""
            self._namespace = ns
        return self._namespace

    def _state(self, request: Any) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState(request)
        else:
            st.request = request
        return st

    def _client_or_none(self) -> LookupClient | None:
        with self._client_lock:
            if self._closed:
                return None
            if self._client is None and self._client_factory is not None:
                try:
                    self._client = self._client_factory()
                except Exception as e:
                    self._log_error("cannot create the cluster client", e)
                    return None
            return self._client

    def start_warm_up(self) -> None:
        """:meth:`warm_up` on a background thread (engine start); lookups made before it
        is done wait for it, up to ``WARM_UP_WAIT_S``, rather than miss."""
        self._connected.clear()

        def run() -> None:
            try:
                self.warm_up()
            finally:
                self._connected.set()

        threading.Thread(target=run, name="pegaflow-warm-up", daemon=True).start()

    def warm_up(self) -> None:
        """Find the node on this host (unless ``local_node`` names it), then connect to
        the coordinator and to that node now, by a locate and a lookup of a block nobody
        has (engine start, on a background thread): the first lookup would otherwise pay
        for the connections and every first use on its path, and past
        ``lookup_timeout_s`` its request would miss the cache."""
        if self.settings.mode == "off":
            return
        client = self._client_or_none()
        if client is None:
            return
        t0 = time.monotonic()
        node = self.finder.find(client)
        if not self.settings.can_load:
            return
        timeout = self.settings.rpc_timeout_s
        probe = [bytes(32)]  # a block nobody stores, in a namespace of its own
        try:
            if node:  # fetches the node records, opens the data plane and control socket
                client.locate(WARM_UP_NS, node, probe, 0, 0.001, timeout)
            # flagged: the coordinator leaves it out of its lookup counts
            client.lookup(WARM_UP_NS, probe, self.shards, timeout, warm_up=True)
            logger.debug("PegaFlow: connected in %.1f ms", (time.monotonic() - t0) * 1e3)
        except Exception as e:
            logger.info("PegaFlow: could not connect ahead of the first lookup: %s", e)

    def _log_error(self, what: str, e: BaseException) -> None:
        now = self._clock()
        if now - self._last_error_log >= 10.0:
            self._last_error_log = now
            logger.warning("PegaFlow: %s: %s: %s (serving goes on)", what, type(e).__name__, e)

    # ---- vLLM hooks ----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the cluster can supply, loaded async."""
        st = self._state(request)
        if not self.settings.can_load:
            return 0, False
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False
        hashes = request.block_hashes
        n = len(hashes)
        start = num_computed_tokens // bs
        if start >= n or (request.num_tokens - 1) // bs <= start:
            # no full block is left before the last token (which vLLM computes anyway):
            # e.g. vLLM's own prefix cache served the rest; no lookup to pay for
            return 0, False
        ns = self.namespace
        if not ns:
            return 0, False
        lk = st.lookup
        now = self._clock()
        ho = self._handoff(st, ns, hashes, now)
        if ho is not None:
            lk, wait = self._await(st, ho, ns, hashes, start, now)
            if wait:
                return None, False
            if lk is None:
                return 0, False
        elif not (
            lk is not None
            and lk.start == start
            and lk.n_hashes == n
            and now - lk.at < self.settings.lookup_cache_s
        ):
            lk = self._lookup(st, ns, hashes, start)
            if lk is None:
                return 0, False
        if lk.hits <= 0:
            return 0, False
        if self._all_local(lk):
            # layer-wise: loaded during the step that computes the rest, so vLLM must
            # have at least one token left to compute
            tokens = min(lk.hits * bs, (request.num_tokens - 1) // bs * bs - num_computed_tokens)
            lk.sync = tokens > 0
            return (tokens, False) if tokens > 0 else (0, False)
        lk.sync = False
        return lk.hits * bs, True

    def _handoff(self, st: _ReqState, ns: str, hashes: Sequence[Any], now: float) -> Handoff | None:
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
            if now - self._last_handoff_warn >= 10.0:
                self._last_handoff_warn = now
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

    def _await(
        self,
        st: _ReqState,
        ho: Handoff,
        ns: str,
        hashes: Sequence[Any],
        start: int,
        now: float,
    ) -> tuple[_Lookup | None, bool]:
        """Look up a handed-off request's blocks: ``(lookup, False)`` once all are stored
        (but the block of the prompt's last token, which vLLM computes anyway), once
        ``handoff_wait_s`` is over, or when the cluster cannot answer (``None``); else
        ``(None, True)``: vLLM asks again in a later step (a new lookup every
        :data:`~.handoff.POLL_S`), serving the other requests meanwhile.  The hit is
        claimed whole: the point of the handoff is that the consumer does not prefill."""
        want = min(ho.blocks, (st.request.num_tokens - 1) // self.block_size)
        if now < st.handoff_poll:
            return None, True
        lk = self._lookup(st, ns, hashes, start, whole=True)
        if lk is not None and start + lk.hits < want and now < st.handoff_until:
            if lk.located:  # this poll's locate pinned what it found: not loaded yet
                self._unpin(lk.pins)
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

    def _all_local(self, lk: _Lookup) -> bool:
        s = self.settings
        local = self.local_node
        if not (s.layerwise and s.same_host_shortcut and local):
            return False
        return _on_node(lk.nodes, local, self.world_size)

    def _lookup(
        self, st: _ReqState, ns: str, hashes: Sequence[Any], start: int, whole: bool = False
    ) -> _Lookup | None:
        if not self.lookup_breaker.allow():
            self.counters.add("lookup_skipped")
            return None
        client = self._client_or_none()
        if client is None:
            self.lookup_breaker.failure()
            self.counters.add("lookup_errors")
            return None
        if self._connected.is_set():
            self.finder.maybe_retry(lambda: self.finder.find(self._client_or_none()))
        else:
            # the engine took a request before the connections were made (it reports
            # ready right after creating the connector): waiting is cheaper than a miss
            t = self._clock()
            self._connected.wait(min(WARM_UP_WAIT_S, self.settings.rpc_timeout_s))
            logger.debug(
                "PegaFlow: %s waited %.1f ms for the engine-start connections",
                st.request.request_id, (self._clock() - t) * 1e3,
            )  # fmt: skip
        asked = block_hashes_bytes(hashes[start:])
        t0 = self._clock()
        timeout = self.settings.lookup_timeout_s
        try:
            with telemetry.span(
                "pegaflow.connector.lookup",
                {"pegaflow.blocks": len(asked)} if telemetry.tracing else None,
                parent=telemetry.request_context(st.request.request_id),
            ):
                located = self._locate(client, ns, asked)
                if located is not None:
                    local = self._answer_locally(start, len(hashes), asked, located)
                    if local is not None:  # the coordinator cannot add to a whole hit
                        self.lookup_breaker.success()
                        self._account(asked, local.hits, "lookups_local")
                        self.same_host.add(self.local_node, len(asked), local.hits)
                        self._claim(st, asked, local, whole)
                        self._debug_lookup(st, asked, local, t0, "answered by the local node")
                        st.lookup = local
                        return local
                res = client.lookup(ns, asked, self.shards, timeout=timeout, generations=True)
            hits = max(0, min(int(res.hits), len(asked)))
            blocks = list(res.blocks or [])
            gens = list(getattr(res, "generations", None) or [])
        except Exception as e:
            self.counters.add("lookup_errors")
            if self.lookup_breaker.failure():
                logger.warning("PegaFlow: lookups failing; pausing them (circuit breaker open)")
            self._log_error("lookup failed", e)
            return None
        finally:
            self.counters.add("lookup_seconds", self._clock() - t0)
        self.lookup_breaker.success()
        # every hit block must name a node for every shard; trust nothing beyond that
        valid = 0
        for b in blocks[:hits]:
            if not isinstance(b, list | tuple) or len(b) != self.world_size:
                break
            if not all(isinstance(x, str) and x for x in b):
                break
            valid += 1
        hits = valid
        self._account(asked, hits, "lookups")
        lk = _Lookup(self._clock(), start, len(hashes), hits, [list(b) for b in blocks[:hits]])
        if len(gens) >= hits and all(
            isinstance(g, list | tuple) and len(g) == self.world_size for g in gens[:hits]
        ):
            lk.gens = [list(g) for g in gens[:hits]]
        self._claim(st, asked, lk, whole)
        if located is not None:
            self._keep_located(lk, located)
        self._debug_lookup(st, asked, lk, t0, "coordinator")
        if lk.hits and self.settings.read_pin_s > 0 and not lk.located:
            self._pin(client, ns, asked[: lk.hits], lk.nodes)
        st.lookup = lk
        return lk

    def _sources(self, lk: _Lookup) -> list[str]:
        """Per hit block, where it loads from: :data:`LOCAL` when every shard is on this
        host's node and the same-host path is on, else the (first) other node."""
        local = self.local_node if self.settings.same_host_shortcut else ""
        out = []
        for row in lk.nodes:
            far = [n for n in row if n != local]
            out.append(far[0] if far else LOCAL)
        return out

    def _claim(self, st: _ReqState, asked: list[bytes], lk: _Lookup, whole: bool = False) -> None:
        """Keep of the hit only what the cost model expects to load faster than vLLM
        computes it (the whole hit, a leading part, or nothing); count the decision.
        A remote node declined for want of recent measurements is probed.  ``whole``:
        keep it all (a handoff)."""
        if lk.hits <= 0 or not self.costs.enabled or whole:
            return
        sources = self._sources(lk)
        s = self.settings
        d = self.costs.choose(sources, layerwise=s.layerwise and s.same_host_shortcut)
        if d.blocks < lk.hits and set(sources) == {LOCAL} and self.costs.wants_probe(LOCAL):
            # this host's pool has no background probe: serving a hit is its measurement
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
            if lk.located and not d.blocks:  # nothing to load: let the node unpin now
                self._unpin(lk.pins)
                lk.located, lk.pins = [], []
            lk.located = [where[: d.blocks] for where in lk.located]

    def _unpin(self, pins: list[int]) -> None:
        """Release the local node's pins of a locate whose blocks will not be loaded
        (fire and forget: an unpin lost only keeps them from eviction a little longer)."""
        client, node = self._client_or_none(), self.local_node
        if client is None or not node:
            return
        timeout = self.settings.rpc_timeout_s
        for pin in pins:
            try:
                client.submit_unpin(node, pin, timeout)
            except Exception as e:
                logger.debug("PegaFlow: unpin failed: %s", e)

    def _debug_claim(self, st: _ReqState, lk: _Lookup, sources: list[str], d: Decision) -> None:
        kinds = sorted({x for x in sources})
        logger.debug(
            "PegaFlow: %s: claim %d of %d hit blocks (%s; from %s): load %.2f ms against "
            "compute %.2f ms (%s)",
            st.request.request_id, d.blocks, lk.hits, d.reason, ", ".join(kinds),
            d.est_load_s * 1e3, d.est_compute_s * 1e3, self.costs.snapshot(),
        )  # fmt: skip

    def _maybe_probe(
        self, asked: list[bytes], lk: _Lookup, sources: list[str], claimed: int
    ) -> None:
        """Time a declined remote node in the background: fetch a few of its blocks into
        the workers' host memory (no request waits on it)."""
        for src in dict.fromkeys(sources[claimed:]):
            if src == LOCAL or not self.costs.wants_probe(src):
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
                    probe=True,
                )
            )
            self.counters.add("probes")

    def learn(self, report: WorkerReport) -> None:
        """Feed the workers' measurements into the cost model."""
        if report.block_bytes:
            self.costs.set_block_bytes(report.block_bytes)
        for source, size, seconds in report.samples:
            if source == "compute":
                self.costs.observe_compute(size, seconds)
            else:
                self.costs.observe_load(source, size, seconds)

    def _account(self, asked: list[bytes], hits: int, kind: str) -> None:
        self.counters.add(kind)
        self.counters.add("lookup_hit_blocks", hits)
        self.counters.add("lookup_miss_blocks", len(asked) - hits)
        self.known.add_many(asked[:hits])
        self.known.discard_many(asked[hits:])

    def _debug_lookup(
        self, st: _ReqState, asked: list[bytes], lk: _Lookup, t0: float, how: str
    ) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "PegaFlow: lookup of %d blocks for %s: %d hits (%s, %s) in %.2f ms",
                len(asked), st.request.request_id, lk.hits, how,
                "located" if lk.located else "not located", (self._clock() - t0) * 1e3,
            )  # fmt: skip

    def _answer_locally(
        self, start: int, n_hashes: int, asked: list[bytes], located: list[Any]
    ) -> _Lookup | None:
        """A lookup answered by the local node alone: when its locates found every asked
        block of every shard (else None: the coordinator's answer is needed)."""
        local = self.local_node
        lk = _Lookup(self._clock(), start, n_hashes, len(asked), [[local] * self.world_size
                     for _ in asked])  # fmt: skip
        self._keep_located(lk, located)
        if not lk.located or lk.hits != len(asked):
            return None
        gen_cols = [where.column("gen").tolist() for where in lk.located]
        lk.gens = [list(g) for g in zip(*gen_cols, strict=True)]
        return lk

    def _locate(self, client: Any, ns: str, asked: list[bytes]) -> list[Any] | None:
        """With layer-wise loads from this host's node: ask the node where the blocks
        are (and pin them) first, one call per shard, so the workers can start copying
        without a round trip of their own; per shard ``(pin, LocatedBlocks)``, or None
        (not asked, or failed).  Only when the node lacks some is the coordinator asked:
        a lookup sent alongside delayed every whole local hit (both answers share the
        client's loop; docs/benchmarks.md, "Same-host control").  Failing locates pause
        for a while (a breaker), so a sick node costs lookups no more than a deadline."""
        s = self.settings
        node = self.local_node
        if not (s.layerwise and s.same_host_shortcut and node and client is not None):
            return None
        if not self.locate_breaker.allow():
            return None
        part = asked[:MAX_LOCATE]
        try:
            deadline = Deadline.after(s.lookup_timeout_s)
            futs = [
                client.submit_locate(ns, node, part, shard, LOCATE_PIN_S, deadline)
                for shard in self.shards
            ]
            got = [f.result(deadline.remaining()) for f in futs]
        except Exception as e:
            self.locate_breaker.failure()
            self._log_error("locate failed", e)
            return None
        self.locate_breaker.success()
        return got

    def _keep_located(self, lk: _Lookup, got: list[Any]) -> None:
        """Keep the locations when every hit is on this host's node; the hits shrink to
        the prefix the node located with the generations the lookup saw."""
        if not lk.hits or not _on_node(lk.nodes, self.local_node, self.world_size):
            return  # not a layer-wise load: the pins expire on their own
        n = lk.hits
        for shard, (_pin, where) in enumerate(got):
            m = min(n, len(where))
            ok = where.found[:m]
            if len(lk.gens) >= m:
                want = np.array([g[shard] for g in lk.gens[:m]], dtype=np.uint64)
                ok = ok & (where.column("gen")[:m] == want)
            bad = np.flatnonzero(~ok)
            n = int(bad[0]) if len(bad) else m
        if n <= 0:
            return
        lk.hits = n
        lk.nodes = lk.nodes[:n]
        lk.gens = lk.gens[:n]
        lk.located = [where[:n] for _pin, where in got]
        lk.pins = [int(pin) for pin, _where in got]
        lk.located_at = time.monotonic()

    def _pin(self, client: Any, ns: str, hashes: Sequence[bytes], nodes: list[list[str]]) -> None:
        """Read pins: ask the nodes to keep the hit blocks from eviction until the load
        (fire and forget; a lost pin only means a possible miss, never wrong bytes)."""
        if client is None:
            return
        items = [
            (node, h, shard)
            for h, row in zip(hashes, nodes, strict=True)
            for shard, node in enumerate(row)
        ]
        try:
            client.submit_pin_blocks(ns, items, self.settings.read_pin_s)
        except Exception as e:
            self._log_error("read pin failed", e)

    def update_state_after_alloc(
        self, request: Any, block_ids: Any, num_external_tokens: int
    ) -> None:
        """Plan the load of the blocks vLLM just allocated for an external hit."""
        st = self._state(request)
        if num_external_tokens <= 0:
            return
        ids = _group0(block_ids)
        bs = self.block_size
        n_load = -(-num_external_tokens // bs)
        lk = st.lookup
        st.lookup = None
        hashes = request.block_hashes
        if lk is None or n_load > lk.hits or len(ids) < lk.start + n_load:
            # vLLM asked for a load we did not offer: answer it with failures, never KV
            start = lk.start if lk is not None else max(0, len(ids) - n_load)
            logger.error(
                "PegaFlow: unexpected load of %d tokens for %s; reporting it failed",
                num_external_tokens,
                request.request_id,
            )
            nodes: list[list[str]] = [[] for _ in range(n_load)]
            gens: list[list[int]] = []
            located: list[LocatedBlocks] = []
        else:
            start = lk.start
            nodes = lk.nodes[:n_load]
            gens = lk.gens[:n_load]
            located = [where[:n_load] for where in lk.located]
        job = LoadJob(
            req_id=request.request_id,
            block_ids=list(ids[start : start + n_load]),
            hashes=block_hashes_bytes(hashes[start : start + n_load]),
            nodes=nodes,
            first_block=start,
            sync=lk is not None and lk.sync,
            gens=gens,
            located=located,
            pins=list(lk.pins) if lk is not None and located else [],
            located_at=lk.located_at if lk is not None else 0.0,
        )
        if len(job.block_ids) != n_load or len(job.hashes) != n_load:
            job.nodes = [[] for _ in job.block_ids]
            job.hashes = (job.hashes + [b"\0"] * len(job.block_ids))[: len(job.block_ids)]
        self._pending_loads.append(job)
        st.loading = not job.sync
        self.counters.add("hit_tokens", num_external_tokens)

    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """This step's :class:`StepPlan` (resets the pending loads and delayed frees)."""
        so = scheduler_output
        plan = StepPlan(namespace=self.namespace if self._reqs or self._pending_loads else "")
        plan.loads, self._pending_loads = self._pending_loads, []
        if self._pending_probes:
            plan.loads += self._pending_probes
            self._pending_probes = []
        num_sched: dict[str, int] = dict(getattr(so, "num_scheduled_tokens", {}) or {})
        plan.tokens = int(sum(num_sched.values()))
        spec: dict[str, Any] = dict(getattr(so, "scheduled_spec_decode_tokens", {}) or {})

        for nr in getattr(so, "scheduled_new_reqs", ()) or ():
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = _group0(nr.block_ids)
            st.loading = False
            after = nr.num_computed_tokens + num_sched.get(nr.req_id, 0)
            after -= len(spec.get(nr.req_id, ()) or ())
            self._plan_save(plan, nr.req_id, st, after)

        cached = getattr(so, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
            for i, rid in enumerate(cached.req_ids):
                st = self._reqs.get(rid)
                if st is None:
                    continue
                nb = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
                if rid in resumed:
                    st.block_ids = _group0(nb) if nb else []
                elif nb:
                    st.block_ids.extend(_group0(nb))
                st.loading = False
                after = cached.num_computed_tokens[i] + num_sched.get(rid, 0)
                after -= len(spec.get(rid, ()) or ())
                self._plan_save(plan, rid, st, after)

        for rid in getattr(so, "preempted_req_ids", None) or ():
            st = self._reqs.get(rid)
            if st is not None:
                st.block_ids = []
            plan.preempted.append(rid)

        plan.delay_free, self._delay_free = self._delay_free, []
        for rid in getattr(so, "finished_req_ids", ()) or ():
            self._reqs.pop(rid, None)
        if plan.saves or plan.loads:
            plan.namespace = self.namespace
        return plan

    def _plan_save(self, plan: StepPlan, rid: str, st: _ReqState, computed_after: int) -> None:
        if not self.settings.can_save:
            return
        req = st.request
        limit = computed_after
        if not self.settings.save_decode_blocks:
            limit = min(limit, int(getattr(req, "num_prompt_tokens", limit)))
        hashes = req.block_hashes
        full = min(limit // self.block_size, len(hashes), len(st.block_ids))
        if full <= st.next_save:
            return
        lo, st.next_save = st.next_save, full
        if not self.settings.saves_prompt:  # a consumer's prompt blocks are its producer's
            lo = max(lo, int(getattr(req, "num_prompt_tokens", 0)) // self.block_size)
        if not self.namespace:
            return
        ids: list[int] = []
        hs: list[bytes] = []
        for i in range(lo, full):
            h = block_hash_bytes(hashes[i])
            bid = st.block_ids[i]
            if bid <= 0:  # vLLM's null block: nothing to save
                continue
            if h in self.known:
                self.counters.add("save_known_blocks")
                continue
            self.known.add(h)
            ids.append(bid)
            hs.append(h)
        if ids:
            plan.saves.append(SaveJob(rid, ids, hs))
            st.saved_any = True
            self.counters.add("save_planned_blocks", len(ids))

    def request_finished(self, request: Any) -> bool:
        """True when vLLM must keep the request's blocks until the worker copied them."""
        st = self._reqs.get(request.request_id)
        if st is not None and telemetry.tracing:
            hits = st.lookup.hits if st.lookup is not None else 0
            telemetry.request_root(request.request_id, st.started_ns, {"pegaflow.hit_blocks": hits})
        if st is None or not st.saved_any or st.loading:
            return False
        self._delay_free.append(request.request_id)
        return True

    def handoff_params(self, request: Any) -> dict[str, Any] | None:
        """A ``kv_producer``'s ``kv_transfer_params`` for a finished request: the
        :class:`~.handoff.Handoff` of the prompt blocks it saved or found stored (None:
        not a producer, or no full block)."""
        st = self._reqs.get(request.request_id)
        ns = self.namespace
        if not self.settings.hands_off or st is None or not ns:
            return None
        hashes = request.block_hashes
        n = min(st.next_save, len(hashes))
        if n <= 0:
            return None
        expires_ms = int((time.time() + self.settings.handoff_ttl_s) * 1000)
        ho = Handoff(ns, n, block_hash_bytes(hashes[n - 1]), self.local_node, expires_ms)
        return ho.to_params()

    def update_connector_output(self, report: WorkerReport | None) -> None:
        """Learn from the workers: failed saves may be saved again, failed loads too."""
        if report is None:
            return
        self.learn(report)
        for h in report.save_failed:
            self.known.discard(h)
        for rid, idx in report.load_failed.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            for h in st.request.block_hashes[idx:]:
                self.known.discard(block_hash_bytes(h))

    def has_state(self, req_id: str) -> bool:
        """Whether the request is tracked (tests)."""
        return req_id in self._reqs

    def _send_report(self, node: str, lookups: int, asked: int, hits: int, timeout: float) -> None:
        """One :class:`SameHostReport` report to ``node`` (raises when it fails)."""
        client = self._client_or_none()
        if client is None:
            raise RuntimeError("no cluster client")
        client.report_lookups(node, lookups, asked, hits, timeout)

    def close(self) -> None:
        """Report the last same-host lookups, then close the lookup client."""
        self.same_host.close()
        with self._client_lock:
            self._closed = True
            c, self._client = self._client, None
        close = getattr(c, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass
