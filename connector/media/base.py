"""Storage media of the worker: the ways KV blocks move between vLLM's cache and storage.

A medium moves a job's blocks and reports what happened to the worker's books
(:class:`~pegaflow.connector.worker.books.WorkerBooks`: counters, the report, holds on blocks
until saves are taken); the worker (:class:`~pegaflow.connector.worker.side.WorkerSide`)
routes jobs between media and keeps the books.  Two media exist:

- :class:`~pegaflow.connector.media.remote.RemoteMedium`: any node, over UCX, through host
  staging memory;
- :class:`~pegaflow.connector.media.poolfile.PoolFileMedium`: the node on this host, straight
  through its mapped pool file; it alone also queues layer-wise loads
  (``start_layerwise``), which need the blocks in this host's memory.

The worker asks them in order (the pool file first, when there is one): a load's blocks
go to the first medium that takes them, a save to the first medium that accepts it.  A
new medium (a disk tier) is one new module implementing :class:`Medium`.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..metadata import LoadJob, SaveJob

BREAKER_OPEN = "saves are failing, so they are paused for a while (circuit breaker)"
"""why saves are dropped while the save breaker is open"""


class Medium(Protocol):
    """One way of moving blocks (see the module docstring)."""

    name: str

    def load(self, client: Any, ns: str, job: LoadJob, ok: list[bool], skip: set[int]) -> set[int]:
        """Load the blocks of ``job`` this medium serves, except those in ``skip``, on
        the calling (load) thread; sets ``ok[i]`` for each block loaded and verified.
        Returns the indexes it handled (loaded or failed): later media skip them."""
        ...

    def submit_save(self, client: Any, ns: str, job: SaveJob, marker: Any) -> bool:
        """Start saving ``job`` (blocks copied out, then sent; the answers go to the
        books); False when this medium cannot take it now (the next one is asked)."""
        ...

    def close(self) -> None:
        """Release what the medium holds (mappings, threads)."""
        ...


def chunks(n: int, size: int) -> list[range]:
    """``range(n)`` in consecutive pieces of at most ``size``."""
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def node_of(job: LoadJob, shard: int, i: int) -> str:
    """The node holding block ``i`` of ``job`` for ``shard`` ('' when none does)."""
    nodes = job.nodes[i] if i < len(job.nodes) else []
    return nodes[shard] if shard < len(nodes) else ""


def gen_of(job: LoadJob, shard: int, i: int) -> int | None:
    """The generation block ``i`` of ``job`` had at lookup for ``shard`` (None: any)."""
    gens = job.gens[i] if i < len(job.gens) else []
    return gens[shard] if shard < len(gens) else None
