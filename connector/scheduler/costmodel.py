"""Never slower than recompute: claim a hit only when loading it beats computing it.

The connector measures, as it runs, what a load costs from each source (this host's
pool, each remote node: a fixed cost and a rate) and what a prefill costs in this
engine (a fixed cost per engine step and a time per token), and claims from a lookup's
hit only what it expects to load faster than vLLM would compute it: the whole hit, a
leading part of it (say, the blocks on this host's node but not those behind a slow
link), or nothing.

An asynchronous load (a hit not held wholly by this host's node) also costs its request
up to one engine step more: vLLM schedules it in the step after the load lands.  The
time per prefilled token is learned from prefill-sized steps only (decode steps say
little about it); the length of a step from the others.  A layer-wise
load (every block on this host's node) runs during the forward pass that computes the
rest of the prompt; its cost is what it adds to that step.

Before anything is measured the model starts from a guess that errs towards computing
where computing is fast: on a GPU, prefill is taken to produce KV at 5 GB/s (an H200
prefills 10,000 tokens of Llama-3.1-8B, 1.31 GB of KV, in about 270 ms), this host's
pool to load at 20 GB/s and a remote node at 1 GB/s (UCX over TCP); on a CPU, prefill
is taken to run at 2,000 tokens/s (it is slower for any real model).  So on a GPU host a
same-host hit is claimed from the first request and a remote one only once a load from
that node was measured fast enough.  A source that was declined for want of
measurements is probed now and then (:meth:`CostModel.wants_probe`): a few of its blocks
are fetched into host memory in the background, which times it without delaying any
request; this host's pool, declined, has its next hit claimed all the same, at most
every :data:`LOCAL_PROBE_INTERVAL_S` (a same-host load has no cheaper probe; while it
stays declined, every same-host hit is computed).  A source's
first load in each worker is not learned from: it pays one-off set-up (mapping and
pinning the pool, connecting, compiling kernels; 0.5-2.2 s on the H200, 2026-12-01), and
a single slow sample counts for at most :data:`SPIKE` times the estimate (two in a row
count in full).

A block only on its node's disk tier (the lookup says so: ``LookupResult.on_disk``) is
priced by a separate estimate of that source, named :func:`disk_source` of it, which
starts from a conservative disk prior (2 GB/s and 1 ms more, and never faster than the
source's memory prior) and learns from the loads whose blocks were on disk; so a hit
mostly on a slow disk is declined where the same hit in memory is taken.  This host's
pool, declined for its disk, has its next hit claimed all the same (as above), so the
disk gets measured; a remote node's disk is probed like the node (a probe's get
promotes the blocks into memory, too).

Each estimate (:class:`LinearCost`) is ``time = fixed + size / rate``, both learned from
every measured load (or step) with exponential forgetting, so a source that turns slow
(a throttled node, a congested link) is declined within a few loads.

Pure module: no vLLM or torch import.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..metadata import LOCAL, memory_source

DECAY = 0.8
"""weight a load estimate keeps per unit of new evidence (about the last 5-10 samples
count: a source that turns slow is seen within a few loads)"""
COMPUTE_DECAY = 0.98
"""the same for the prefill estimate (about the last 50 prefill steps count).  What a
token costs this engine does not change as a link's speed does, while the length of a
step varies with what else the device runs (four engines on one H200): over 5-10 steps
that noise can pass for a time per token near zero, and then every hit is declined."""
PROBE_INTERVAL_S = 30.0
"""least time between two probes of one source"""
LOCAL_PROBE_INTERVAL_S = 5.0
"""the same for this host's pool in memory: a probe costs one request at most a
same-host load's time, a wrong decline costs every same-host hit until the next one"""
PROBE_BYTES = 64 << 20
"""most bytes one probe fetches"""
SPIKE = 2.0
"""a sample over this many times the current estimate counts as only that much, unless
the sample before it was over too: one stall (a page fault storm, a GC pause) does not
turn a source into a decline, a source that stays slow is taken at its word from its
second slow sample on"""
MIN_PREFILL_TOKENS = 256
"""steps of at least this many tokens teach the time per prefilled token; smaller ones
(decodes, short prefills, dominated by each step's fixed cost and by reading the
weights) only the length of a step"""


@dataclass(frozen=True)
class Prior:
    """The guesses the model starts from (see the module's docstring)."""

    compute_kv_rate: float
    """bytes of KV per second prefill produces (GPU); 0: use ``compute_tokens_per_s``"""
    compute_tokens_per_s: float
    step_s: float
    local_rate: float
    local_fixed_s: float
    remote_rate: float
    remote_fixed_s: float
    disk_rate: float = 2e9
    """a disk tier's read rate (a conservative NVMe figure); a source's disk estimate
    starts at the lower of this and its memory rate"""
    disk_fixed_s: float = 0.001
    """what a disk read adds to a source's fixed cost"""


GPU_PRIOR = Prior(5e9, 0.0, 0.005, 20e9, 0.0005, 1e9, 0.002)
CPU_PRIOR = Prior(0.0, 2000.0, 0.005, 5e9, 0.0005, 1e9, 0.002)


class LinearCost:
    """``time(size) = fixed_s + size / rate``, fitted to ``(size, seconds)`` samples.

    Weighted least squares on relative errors (a 2 ms load off by 1 ms counts as much
    as a 2 s load off by 1 s: each sample is weighed by the prior's time for its size),
    with exponential forgetting (each sample's weight is multiplied by ``DECAY`` at
    every later sample) and a weak pull towards the prior,
    which decides only what the samples cannot: samples of one size (prompts of one
    length) fix the time at that size, not how it splits into a fixed cost and a rate.
    Garbage (negative, infinite, NaN) is ignored.
    """

    def __init__(
        self, fixed_s: float, rate: float, decay: float = DECAY, prior_weight: float = 1e-6
    ) -> None:
        self._decay = decay
        self._lam = prior_weight
        self._A = max(fixed_s, 1e-6)  # the scales: parameters are fitted as multiples
        self._B = 1.0 / rate
        self._m = [0.0, 0.0, 0.0]  # data part of the normal matrix: [aa, ab, bb]
        self._r = [0.0, 0.0]
        self.fixed_s = max(0.0, fixed_s)
        self._per_unit = self._B
        self.samples = 0
        self.last_at = -math.inf
        self._spiked = False
        """the last sample was over SPIKE times the estimate"""

    @property
    def rate(self) -> float:
        """Estimated rate (size units per second)."""
        return 1.0 / self._per_unit

    def estimate(self, size: float) -> float:
        """Expected seconds for ``size``."""
        return self.fixed_s + size * self._per_unit

    def observe(self, size: float, seconds: float, at: float | None = None) -> None:
        """Learn from one measured operation."""
        if not (math.isfinite(size) and math.isfinite(seconds)) or size <= 0 or seconds < 0:
            return
        cap = SPIKE * self.estimate(size)
        if seconds > cap and not self._spiked:
            self._spiked, seconds = True, cap
        else:
            self._spiked = seconds > cap
        d = self._decay
        # relative errors, by the prior's time for this size: samples of one size weigh
        # the same whatever they measured, so a slowdown shows as fast as a speed-up
        v = 1.0 / (self._A + self._B * size) ** 2
        ua, ub = self._A, self._B * size
        m, r = self._m, self._r
        m[0], m[1], m[2] = d * m[0] + v * ua * ua, d * m[1] + v * ua * ub, d * m[2] + v * ub * ub
        r[0], r[1] = d * r[0] + v * seconds * ua, d * r[1] + v * seconds * ub
        self._solve()
        self.samples += 1
        self.last_at = time.monotonic() if at is None else at

    def _solve(self) -> None:
        lam, (maa, mab, mbb), (ra, rb) = self._lam, self._m, self._r
        maa, mbb, ra, rb = maa + lam, mbb + lam, ra + lam, rb + lam  # prior: (1, 1)
        det = maa * mbb - mab * mab
        alpha = (ra * mbb - rb * mab) / det
        beta = (rb * maa - ra * mab) / det
        if alpha < 0:  # no negative fixed cost: the best line through the origin
            alpha, beta = 0.0, rb / mbb
        if beta <= 1e-9:  # no infinite rate: the best constant
            beta = 1e-9
            alpha = max(0.0, (ra - mab * beta) / maa)
        self.fixed_s = alpha * self._A
        self._per_unit = beta * self._B


@dataclass(frozen=True)
class Decision:
    """What to claim of a hit."""

    blocks: int
    """leading blocks to claim (0: none, compute them all)"""
    sync: bool
    """claimed blocks load layer by layer during the forward pass (all on this host)"""
    est_load_s: float
    """expected load time of the claimed blocks (of the whole hit when none is)"""
    est_compute_s: float
    """expected compute time of the same blocks"""
    reason: str
    """'whole', 'part', 'declined', 'off' (model off: everything claimed) or 'empty'"""


class CostModel:
    """Per-source load costs and this engine's prefill cost; decides what to claim.

    Args:
        device: the engine's device type ('cpu', 'cuda' ...): picks the prior.
        block_size: tokens per block.
        block_bytes: bytes of one block of one shard (what one worker moves).
        enabled: off: every hit is claimed whole (no cost model).
        clock: monotonic clock (tests inject one).
    """

    def __init__(
        self,
        device: str,
        block_size: int,
        block_bytes: int,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prior = CPU_PRIOR if device == "cpu" else GPU_PRIOR
        self.block_size = max(1, block_size)
        self.block_bytes = max(1, block_bytes)
        self.enabled = enabled
        self._clock = clock
        p = self.prior
        per_token = (
            self.block_bytes / self.block_size / p.compute_kv_rate
            if p.compute_kv_rate
            else 1.0 / p.compute_tokens_per_s
        )
        self.compute = LinearCost(p.step_s, 1.0 / per_token, decay=COMPUTE_DECAY)
        """time of a step of N tokens, from prefill-sized steps"""
        self._step_w, self._step_sum = 1.0, p.step_s  # recent small steps (mean)
        self.sources: dict[str, LinearCost] = {}
        self._probed: dict[str, float] = {}

    def source(self, name: str) -> LinearCost:
        """The cost of loading from ``name`` (:data:`LOCAL`, a node id, or the
        :func:`disk_source` of either)."""
        c = self.sources.get(name)
        if c is None:
            p = self.prior
            base = memory_source(name)
            fixed, rate = (
                (p.local_fixed_s, p.local_rate)
                if base == LOCAL
                else (p.remote_fixed_s, p.remote_rate)
            )
            if base != name:
                fixed, rate = fixed + p.disk_fixed_s, min(rate, p.disk_rate)
            c = self.sources[name] = LinearCost(fixed, rate)
        return c

    # ---- learning ------------------------------------------------------------------

    def observe_load(self, source: str, nbytes: float, seconds: float) -> None:
        """A measured load of ``nbytes`` (one shard) from ``source`` (the
        :func:`disk_source` of a source: its blocks were on disk)."""
        self.source(source).observe(nbytes, seconds, self._clock())

    def observe_compute(self, tokens: float, seconds: float) -> None:
        """A measured forward pass of ``tokens`` scheduled tokens."""
        if tokens >= MIN_PREFILL_TOKENS:
            self.compute.observe(tokens, seconds, self._clock())
        elif tokens > 0 and math.isfinite(seconds) and seconds >= 0:
            self._step_w = DECAY * self._step_w + 1.0
            self._step_sum = DECAY * self._step_sum + seconds

    def set_block_bytes(self, block_bytes: int) -> None:
        """The exact bytes of a block of one shard (the workers know it)."""
        if block_bytes > 0:
            self.block_bytes = block_bytes

    # ---- estimates -----------------------------------------------------------------

    @property
    def step_s(self) -> float:
        """What an asynchronous load adds to its request besides the load: it waits for
        the next step to start (the recent length of a small step)."""
        return self._step_sum / self._step_w

    def compute_s(self, tokens: float) -> float:
        """What computing ``tokens`` more adds to a step (the marginal cost)."""
        return tokens / self.compute.rate

    def load_s(self, blocks_by_source: dict[str, int], sync: bool) -> float:
        """Expected time to load these blocks (plus an engine step unless ``sync``)."""
        t = sum(self.source(s).estimate(n * self.block_bytes) for s, n in blocks_by_source.items())
        return t if sync else t + self.step_s

    def choose(self, sources: Sequence[str], layerwise: bool) -> Decision:
        """What to claim of a hit whose block ``i`` is held by ``sources[i]``
        (:data:`LOCAL` for this host's node, the :func:`disk_source` of a source for a
        block on its disk tier).  ``layerwise``: a hit wholly in this host's node's
        memory loads during the forward pass (else asynchronously)."""
        n = len(sources)
        if n == 0:
            return Decision(0, False, 0.0, 0.0, "empty")
        if not self.enabled:
            sync = layerwise and all(s == LOCAL for s in sources)
            return Decision(n, sync, 0.0, 0.0, "off")
        best: tuple[float, int, bool, float, float] | None = None
        counts: dict[str, int] = {}
        last = (0.0, 0.0)
        for k in range(1, n + 1):
            s = sources[k - 1]
            counts[s] = counts.get(s, 0) + 1
            if k < n and sources[k] == s:
                continue  # only the ends of runs of one source can be best
            sync = layerwise and len(counts) == 1 and LOCAL in counts
            load = self.load_s(counts, sync)
            comp = self.compute_s(k * self.block_size)
            last = (load, comp)
            gain = comp - load
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, k, sync, load, comp)
        if best is None:
            return Decision(0, False, last[0], last[1], "declined")
        _gain, k, sync, load, comp = best
        return Decision(k, sync, load, comp, "whole" if k == n else "part")

    def load_budget_s(self, tokens: int, factor: float, floor: float, cap: float) -> float:
        """How long a load of ``tokens`` may wait before they are computed instead:
        ``factor`` times what computing them is expected to take (a step of that many
        tokens), at least ``floor``, at most ``cap`` (``cap`` when ``factor`` is 0).
        Before anything is measured the estimate is the prior's, which errs slow on a
        CPU (a longer budget), and on a GPU ``floor`` decides."""
        if factor <= 0:
            return cap
        return min(cap, max(floor, factor * self.compute.estimate(max(0, tokens))))

    def wants_probe(self, source: str) -> bool:
        """Whether to time ``source`` now: it was declined, nothing measured it for
        :data:`PROBE_INTERVAL_S` (:data:`LOCAL_PROBE_INTERVAL_S` for this host's pool in
        memory), and it was not probed that recently.  Marks it probed."""
        now = self._clock()
        c = self.source(source)
        every = LOCAL_PROBE_INTERVAL_S if source == LOCAL else PROBE_INTERVAL_S
        if now - c.last_at < every or now - self._probed.get(source, -math.inf) < every:
            return False
        self._probed[source] = now
        return True

    def probe_blocks(self) -> int:
        """Blocks one probe fetches."""
        return max(1, PROBE_BYTES // self.block_bytes)

    def explain(self) -> str:
        """The estimates a decision rests on, in words (for the engine log's cache line):
        computing, a step, and each source's load rate and fixed cost."""
        parts = [
            f"computing {self.compute.rate:,.0f} tokens/s",
            f"a step {self.step_s * 1e3:.1f} ms",
        ]
        for name, c in list(self.sources.items()):
            where = "this host" if name == LOCAL else name
            parts.append(f"loading from {where} {c.rate / 1e9:.1f} GB/s + {c.fixed_s * 1e3:.1f} ms")
        return ", ".join(parts)

    def snapshot(self) -> dict[str, Any]:
        """The current estimates (for logs and tests)."""
        return {
            "compute_tokens_per_s": round(self.compute.rate, 1),
            "step_s": round(self.step_s, 6),
            "block_bytes": self.block_bytes,
            "sources": {
                name: {
                    "GBps": round(c.rate / 1e9, 3),
                    "fixed_ms": round(c.fixed_s * 1e3, 3),
                    "samples": c.samples,
                }
                for name, c in self.sources.items()
            },
        }
