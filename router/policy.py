"""Replicas and the choice of one per request: round robin, least loaded, cache affinity.

Pure logic (no I/O): the server (:mod:`pegaflow.router.server`) keeps each replica's
health and in-flight count up to date and asks a :class:`Picker` where to send.

A replica is in rotation while its ``/health`` answers 200 *and* its answers do not
fail: a replica can answer its ``/health`` and still fail every request (a broken
engine behind a live API server answering 500 at once), and least-loaded routing would
send it the most (it has nothing in flight).  So ``eject_after`` failed answers in a row
(5xx, connection errors, broken or truncated streams) take it out for ``eject_s``
whatever its ``/health`` says (:meth:`Replica.note_failure`); then it gets one trial
request at a time: a success puts it back, a failure takes it out again for twice as
long (at most ``2**MAX_EJECT_DOUBLINGS`` times ``eject_s``).  The answer to a request
sent before the ejection began, good or bad, is no trial: a long stream ending well
used to put back a replica that failed everything sent since.

Ejection never leaves a role without a replica: when every replica of a role whose
``/health`` answers is ejected, requests go to those (as Envoy's panic routing does),
since a replica that failed lately beats a sure 503, and its first good answer puts it
back.  ``scripts/chaos_router.py`` saw a replica whose fault had ended kept out while
the other of its role was ejected: 883 requests answered 503 in 2.3 s, both serving.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pegaflow.errors import BadRequest

ROLES = ("both", "prefill", "decode")
MODES = ("rr", "cache", "pd")
REPLICA_SPEC = (
    "URL[;role=both|prefill|decode][;node=NODE_ID][;host=HOST][;events=ZMQ][;replay=ZMQ]"
)
_SPEC_KEYS = ("role", "node", "host", "events", "replay")
MAX_EJECT_DOUBLINGS = 5
"""an ejection lasts at most ``eject_s * 2**MAX_EJECT_DOUBLINGS``"""


@dataclass
class Replica:
    """One vLLM OpenAI server behind the router."""

    url: str
    role: str = "both"
    node: str = ""
    """id of the storage node on the replica's host (cache mode)"""
    host: str = ""
    """the replica's host as the nodes' records name it (cache mode; default: the URL's)"""
    events: str = ""
    """the engine's KV events publisher (``tcp://HOST:PORT``; cache mode)"""
    replay: str = ""
    """the engine's KV events replay endpoint (``tcp://HOST:PORT``; cache mode)"""
    healthy: bool = False
    inflight: int = 0
    queued_blocks: float = 0.0
    """prefill work of the requests sent here that have no answer bytes yet: the prompt
    blocks each computes (its length less what the replica held of it, cache mode)"""
    requests: int = 0
    failures: int = 0
    last_error: str = ""
    failed_in_row: int = 0
    """answers that failed since the last one that did not"""
    ejected_at: float = 0.0
    """monotonic time the current ejection began"""
    ejected_until: float = 0.0
    """monotonic time the current ejection ends (see the module docstring)"""
    ejections: int = 0
    """ejections in a row; 0: not ejected nor on trial"""

    def available(self, now: float) -> bool:
        """Whether a request may go here: healthy, not ejected, and (on trial after an
        ejection) no other request in flight."""
        if not self.healthy:
            return False
        return self.ejections == 0 or (now >= self.ejected_until and self.inflight == 0)

    def note_success(self, sent: float | None = None) -> bool:
        """An answer that did not fail, to a request sent at ``sent`` (monotonic; None:
        now); ``True`` when it ends an ejection (back in rotation).  A request sent
        before the ejection began is no trial: its answer changes nothing."""
        if self.ejections and sent is not None and sent < self.ejected_at:
            return False
        self.failed_in_row = 0
        back, self.ejections = self.ejections > 0, 0
        return back

    def note_failure(
        self, now: float, eject_after: int, eject_s: float, sent: float | None = None
    ) -> float:
        """A failed answer to a request sent at ``sent`` (None: now); the seconds of the
        ejection it starts, 0 for none."""
        self.failed_in_row += 1
        if self.ejections == 0 and self.failed_in_row < max(1, eject_after):
            return 0.0
        sent = now if sent is None else sent
        if self.ejections and (now < self.ejected_until or sent < self.ejected_at):
            return 0.0  # out already, or a request sent before the ejection: no trial
        seconds = eject_s * 2 ** min(self.ejections, MAX_EJECT_DOUBLINGS)
        self.ejections += 1
        self.ejected_at = now
        self.ejected_until = now + seconds
        return seconds

    def serves(self, role: str) -> bool:
        """Whether this replica takes requests of ``role`` (``both``: any)."""
        return role == "both" or self.role in (role, "both")

    def status(self) -> dict[str, object]:
        """The replica as ``/v1/status`` shows it: ``healthy`` while in rotation (its
        ``/health`` answers and it is not ejected), ``ejected_s`` left of an ejection."""
        left = max(0.0, self.ejected_until - time.monotonic()) if self.ejections else 0.0
        return {
            "url": self.url,
            "role": self.role,
            "node": self.node,
            "host": self.host,
            "events": self.events,
            "healthy": self.healthy and left == 0.0,
            "ejected_s": round(left, 1),
            "inflight": self.inflight,
            "queued_blocks": round(self.queued_blocks, 1),
            "requests": self.requests,
            "failures": self.failures,
            "last_error": self.last_error,
        }


def parse_replica(spec: str) -> Replica:
    """A replica from :data:`REPLICA_SPEC`; ``BadRequest`` naming what is wrong otherwise."""
    parts = [p.strip() for p in spec.split(";")]
    url = parts[0].rstrip("/")
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
        raise BadRequest(f"replica {spec!r}: not a base URL like http://10.0.0.5:8000")
    try:
        u.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise BadRequest(f"replica {spec!r}: bad port") from None
    rep = Replica(url=url, host=u.hostname)
    for p in parts[1:]:
        key, sep, value = p.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value or key not in _SPEC_KEYS:
            keys = ", ".join(f"{k}=" for k in _SPEC_KEYS)
            raise BadRequest(f"replica {spec!r}: {p!r} is not one of {keys} (with a value)")
        if key == "role" and value not in ROLES:
            raise BadRequest(f"replica {spec!r}: role must be one of {', '.join(ROLES)}")
        if key in ("events", "replay") and not value.startswith(("tcp://", "ipc://")):
            raise BadRequest(f"replica {spec!r}: {key}= is a ZMQ address like tcp://HOST:5557")
        setattr(rep, key, value)
    if rep.replay and not rep.events:
        raise BadRequest(f"replica {spec!r}: replay= without events=")
    return rep


def parse_replicas(specs: Iterable[str], mode: str) -> list[Replica]:
    """Every replica of ``specs`` for ``mode``; ``BadRequest`` when the set cannot serve
    it (none at all, a URL twice, P/D without a prefill or a decode replica)."""
    if mode not in MODES:
        raise BadRequest(f"unknown router mode {mode!r} (one of {', '.join(MODES)})")
    reps = [parse_replica(s) for s in specs]
    if not reps:
        raise BadRequest(f"no replicas: give --router-replicas {REPLICA_SPEC}[,...]")
    urls = [r.url for r in reps]
    if len(set(urls)) != len(urls):
        raise BadRequest(f"a replica is listed twice: {', '.join(urls)}")
    if mode == "pd":
        for role in ("prefill", "decode"):
            if not any(r.role == role or r.role == "both" for r in reps):
                raise BadRequest(f"pd mode needs a replica with role={role} (or role=both)")
    return reps


@dataclass(frozen=True)
class Choice:
    """Where one request goes, and why (a ``pegaflow_router_routes_total`` decision)."""

    replica: Replica | None
    decision: str
    blocks: float = 0
    """the chosen replica's score (cache mode: prefix blocks it holds, :func:`tier_scores`)"""
    work: float = 0
    """prompt blocks the chosen replica computes for this request (cache mode): counted in
    its ``queued_blocks`` until the answer's first bytes"""


@dataclass
class Picker:
    """Chooses replicas.  Cache mode prices each candidate by when it would finish this
    request's prefill (:meth:`by_affinity`): ``queue_weight`` per block of prefill queued
    there, ``load_blocks`` per request in flight; ``max_inflight`` caps what affinity may
    send to one replica."""

    replicas: Sequence[Replica]
    max_inflight: int = 64
    queue_weight: float = 1.0
    load_blocks: float = 0.0
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    def candidates(self, role: str, exclude: Iterable[str] = ()) -> list[Replica]:
        """Replicas serving ``role`` in rotation, not among the URLs of ``exclude``; when
        none is, those whose ``/health`` answers all the same (ejected or on trial: see
        the module docstring)."""
        ex, now = set(exclude), time.monotonic()
        up = [r for r in self.replicas if r.healthy and r.serves(role) and r.url not in ex]
        return [r for r in up if r.available(now)] or up

    def round_robin(self, role: str = "both", exclude: Iterable[str] = ()) -> Replica | None:
        """The next healthy replica in turn (``None``: none is healthy)."""
        cands = self.candidates(role, exclude)
        if not cands:
            return None
        return cands[next(self._rr) % len(cands)]

    def least_loaded(self, role: str = "both", exclude: Iterable[str] = ()) -> Replica | None:
        """The healthy replica with the fewest requests in flight; ties in turn."""
        cands = self.candidates(role, exclude)
        if not cands:
            return None
        low = min(r.inflight for r in cands)
        tied = [r for r in cands if r.inflight == low]
        return tied[next(self._rr) % len(tied)]

    def cost(self, r: Replica, score: float) -> float:
        """What sending a request to ``r`` costs in prompt blocks computed before its
        first token, less the same for a replica that is idle and holds nothing: the
        prefill queued there and its requests in flight, less what its holdings save
        (``score``, :func:`tier_scores`)."""
        return self.queue_weight * r.queued_blocks + self.load_blocks * r.inflight - score

    def by_affinity(
        self,
        scores: Mapping[str, float],
        role: str = "both",
        exclude: Iterable[str] = (),
    ) -> Choice:
        """The replica of the least :meth:`cost` (by replica URL, :func:`tier_scores`),
        holders over the in-flight cap left out; ties to the higher score, then the least
        loaded.  Decisions: ``affinity`` (a holder), ``balanced`` (a replica holding none,
        as the holders' queues cost more than they save), ``miss`` (no holder), ``capped``
        (every holder at the cap: the least loaded replica)."""
        cands = self.candidates(role, exclude)
        if not cands:
            return Choice(None, "miss")
        held = [r for r in cands if scores.get(r.url, 0) > 0]
        if held and all(r.inflight >= self.max_inflight for r in held):
            return Choice(self.least_loaded(role, exclude), "capped")
        open_ = [r for r in cands if scores.get(r.url, 0) <= 0 or r.inflight < self.max_inflight]
        priced = [(self.cost(r, scores.get(r.url, 0)), -scores.get(r.url, 0), r.inflight, r)
                  for r in open_]  # fmt: skip
        best = min(p[:3] for p in priced)
        tied = [p[3] for p in priced if p[:3] == best]
        r = tied[next(self._rr) % len(tied)]
        score = scores.get(r.url, 0)
        decision = "affinity" if score > 0 else "balanced" if held else "miss"
        return Choice(r, decision, score)


def node_scores(
    replicas: Sequence[Replica],
    block_nodes: Sequence[str],
    node_hosts: Mapping[str, str],
) -> dict[str, int]:
    """Per replica URL, how many of a lookup's hit blocks lie on its host's node.

    ``block_nodes``: the node id holding each hit block (shard 0); ``node_hosts``: node
    id -> data-plane host.  A replica configured with ``node=`` matches that node only;
    else its ``host`` matches nodes on the same host."""
    per_node: dict[str, int] = {}
    for nid in block_nodes:
        per_node[nid] = per_node.get(nid, 0) + 1
    out: dict[str, int] = {}
    for r in replicas:
        if r.node:
            n = per_node.get(r.node, 0)
        else:
            n = sum(c for nid, c in per_node.items() if node_hosts.get(nid) == r.host)
        if n:
            out[r.url] = n
    return out


@dataclass(frozen=True)
class TierWeights:
    """What one prefix block held in each place saves of its prefill, as a share of what
    it saves on the engine's own GPU (docs/router.md gives the measurements)."""

    pool: float = 0.89
    """on the replica's host's node"""
    remote: float = 0.67
    """on another node"""


def tier_scores(
    replicas: Sequence[Replica],
    gpu: Mapping[str, int],
    local: Mapping[str, int],
    stored: int,
    weights: TierWeights,
) -> dict[str, float]:
    """Per replica URL, what its holdings of a prompt's prefix save over a replica that
    holds nothing (which still loads the pool's ``stored`` blocks from elsewhere).

    ``gpu``: blocks of the prefix in the replica's own GPU cache; ``local``: of the pool's
    ``stored`` blocks, those on its host's node (:func:`node_scores`).  The blocks past
    its GPU prefix come from its host's node while it holds them, else from another."""
    out: dict[str, float] = {}
    for r in replicas:
        g, near, far = tier_split(gpu.get(r.url, 0), local.get(r.url, 0), stored)
        score = g + weights.pool * near + weights.remote * (far - stored)
        if score > 1e-9:
            out[r.url] = score
    return out


def tier_split(gpu_blocks: int, local_blocks: int, stored: int) -> tuple[int, int, int]:
    """Where a replica finds its prefix: ``(blocks in its GPU cache, past them on its
    host's node, past them elsewhere in the pool)``; ``local_blocks``: of the pool's
    ``stored`` blocks, those on its host's node."""
    beyond = max(0, stored - gpu_blocks)
    near = min(beyond, local_blocks)
    return gpu_blocks, near, beyond - near


def prefill_blocks(prompt_blocks: int, score: float, stored: int, weights: TierWeights) -> float:
    """The prompt blocks a replica of :func:`tier_scores` score ``score`` still computes
    (its share of a load counted as computing saved): the score is what it saves over a
    replica that loads the pool's ``stored`` blocks from another node."""
    return max(0.0, prompt_blocks - score - weights.remote * stored)


class RecentRoutes:
    """Bounded memory of where recent prompts went: last full-block hash -> replica
    URL.  Covers the moments before a replica's saves are committed in the index (a
    conversation's next turn may come sooner)."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._map: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def remember(self, hashes: Sequence[bytes], url: str) -> None:
        """Note that the prompt of ``hashes`` went to ``url``."""
        if not hashes or self.capacity <= 0:
            return
        self._map[hashes[-1]] = url
        self._map.move_to_end(hashes[-1])
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def longest(self, hashes: Sequence[bytes]) -> tuple[int, str]:
        """``(blocks, url)`` of the longest remembered prefix of ``hashes`` (0, "")."""
        for i in range(len(hashes) - 1, -1, -1):
            url = self._map.get(hashes[i])
            if url is not None:
                return i + 1, url
        return 0, ""
