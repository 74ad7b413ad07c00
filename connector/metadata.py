"""What the scheduler-side connector tells the workers each step, and what they answer.

Plain dataclasses of builtins (and the numpy columns of block locations): vLLM moves
them between its own processes (scheduler to workers and back), never over PegaFlow's
network.  Pure module: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pegaflow.protocol.codec import LocatedBlocks

LOCAL = "local"
"""the source name of this host's node (its pool file, no network)"""
ON_DISK = "@disk"
"""suffix of a source's disk-tier name (:func:`disk_source`)"""


def disk_source(name: str) -> str:
    """The source name of blocks of ``name`` (:data:`LOCAL` or a node id) that are only
    on its disk tier: they have an estimate of their own."""
    return name + ON_DISK


def memory_source(name: str) -> str:
    """The source a :func:`disk_source` name is of (``name`` itself otherwise)."""
    return name[: -len(ON_DISK)] if name.endswith(ON_DISK) else name


@dataclass
class LoadJob:
    """Pull ``hashes[i]`` into vLLM block ``block_ids[i]``; report ``req_id`` when done."""

    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    nodes: list[list[str]]
    """per block, the node id holding each shard (index = shard)"""
    first_block: int = 0
    """index of ``block_ids[0]`` within the request (for logs)"""
    gens: list[list[int]] = field(default_factory=list)
    """per block, the generation of each shard the lookup saw (empty: unknown); a
    node whose slot now holds another generation answers a miss (fencing)"""
    sync: bool = False
    """loaded during this step's forward pass, layer by layer (vLLM schedules the
    request at once); else asynchronously, before vLLM schedules it"""
    located: list[LocatedBlocks] = field(default_factory=list)
    """per shard: where the blocks are in the pool file of this host's node, located
    (and pinned) by the scheduler; empty when not located: the worker then locates
    them itself"""
    pins: list[int] = field(default_factory=list)
    """per shard, the node's pin on the located blocks (the worker releases it)"""
    located_at: float = 0.0
    """``time.monotonic()`` of the locate (the pin lasts ``LOCATE_PIN_S``)"""
    disk: list[bool] = field(default_factory=list)
    """per block, whether the lookup saw it only on its node's disk tier (empty: all in
    memory); the worker files its load's measurement under the disk's estimate"""
    budget_s: float = 0.0
    """how long the load from other hosts may wait before its blocks are reported failed
    and computed (:meth:`~.scheduler.costmodel.CostModel.load_budget_s`: about what computing
    them takes); 0: ``transfer_timeout_s``"""
    probe: bool = False
    """not a load: fetch the blocks into host memory only, to time their node (see
    :meth:`pegaflow.connector.scheduler.costmodel.CostModel.wants_probe`); ``block_ids`` is empty"""

    def mostly_on_disk(self, idx: Iterable[int]) -> bool:
        """Whether most of blocks ``idx`` were on a disk tier (their load's time then
        teaches the disk's estimate)."""
        disk = self.disk
        flags = [disk[i] if i < len(disk) else False for i in idx]
        return 2 * sum(flags) > len(flags)


@dataclass
class SaveJob:
    """Copy vLLM blocks ``block_ids`` out and store them under ``hashes``."""

    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    filled_at: float = 0.0
    """when the worker queued it, right after the step that filled its blocks
    (``time.monotonic``; 0: not queued)"""
    owners: list[str] = field(default_factory=list)
    """the requests of the queued jobs this one merges (:func:`merge_saves`), one entry
    per job; empty: ``req_id``'s own"""

    @property
    def holders(self) -> list[str]:
        """The request of each queued job whose blocks this job holds from reuse."""
        return self.owners or [self.req_id]


def merge_saves(jobs: Sequence[SaveJob]) -> SaveJob:
    """One job for queued save jobs ``jobs`` (in queue order), so that they are copied
    out and committed together (one reservation, one copy, one commit); a hash in
    several of them is stored once.  It holds the blocks of every job merged and counts
    from the earliest ``filled_at``."""
    if len(jobs) == 1:
        return jobs[0]
    ids: list[int] = []
    hashes: list[bytes] = []
    seen: set[bytes] = set()
    for job in jobs:
        for b, h in zip(job.block_ids, job.hashes, strict=True):
            if h not in seen:
                seen.add(h)
                ids.append(b)
                hashes.append(h)
    filled = min((j.filled_at for j in jobs if j.filled_at), default=0.0)
    return SaveJob(jobs[0].req_id, ids, hashes, filled, [r for j in jobs for r in j.holders])


@dataclass
class StepPlan:
    """One engine step's connector work for every worker."""

    namespace: str = ""
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    """requests preempted this step: their pending block copies must finish first"""
    delay_free: list[str] = field(default_factory=list)
    """finished requests whose blocks vLLM keeps until the worker reports them sent"""
    tokens: int = 0
    """tokens scheduled in this step (the workers time the forward pass against it)"""

    def is_empty(self) -> bool:
        """No work at all (the namespace alone is not work)."""
        return not (self.loads or self.saves or self.preempted or self.delay_free)


@dataclass
class WorkerReport:
    """Worker to scheduler: outcomes that change what the scheduler believes is stored."""

    save_failed: list[bytes] = field(default_factory=list)
    """hashes whose save failed or was dropped (may be saved again later)"""
    unsaved: dict[str, list[bytes]] = field(default_factory=dict)
    """the same hashes by why (:func:`~pegaflow.protocol.misses.unsaved_reason`): a later
    miss of one is counted as ``save_dropped`` or ``quota``"""
    load_failed: dict[str, int] = field(default_factory=dict)
    """request id -> index (within the request) of its first block that failed to load"""
    samples: list[tuple[str, int, float]] = field(default_factory=list)
    """measurements for the cost model: ``(source, bytes, seconds)`` of a load from
    ``source`` (``"local"`` or a node id, or the :func:`disk_source` of one
    when most of its blocks were on disk), ``("compute", tokens, seconds)`` of a
    forward pass"""
    block_bytes: int = 0
    """bytes of one block of this worker's shard (0: not known yet)"""
    down_nodes: list[str] = field(default_factory=list)
    """nodes that failed this worker's loads and have not answered since
    (:mod:`pegaflow.client.nodehealth`), in every report while they are: the scheduler
    declines their hits meanwhile (with workers in processes of their own too)"""

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Union of two workers' reports (the earliest failure wins)."""
        out = WorkerReport(list(self.save_failed), dict(self.load_failed))
        out.save_failed.extend(h for h in other.save_failed if h not in set(self.save_failed))
        for rid, idx in other.load_failed.items():
            out.load_failed[rid] = min(idx, out.load_failed.get(rid, idx))
        out.samples = self.samples + other.samples
        out.block_bytes = max(self.block_bytes, other.block_bytes)
        out.down_nodes = sorted(set(self.down_nodes) | set(other.down_nodes))
        for src in (self.unsaved, other.unsaved):
            for why, hashes in src.items():
                out.unsaved.setdefault(why, []).extend(hashes)
        return out

    def is_empty(self) -> bool:
        """Nothing to report."""
        return not (self.save_failed or self.load_failed or self.samples or self.down_nodes)
