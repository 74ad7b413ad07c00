"""Storage media of the worker: the ways KV blocks move between vLLM's cache and storage.

A medium takes the loads and saves the worker submits and hands back what became of
them, as results: a :class:`LoadResult` per load (each block's outcome, the bytes and
seconds of each source, for the cost model), a :class:`SaveResult` per save answered.
The worker (:class:`~pegaflow.connector.worker.side.WorkerSide`) routes jobs between
media and keeps the books from the results; a medium never touches them.  Two media
exist:

- :class:`~pegaflow.connector.media.remote.RemoteMedium`: any node, over UCX, through
  host staging memory;
- :class:`~pegaflow.connector.media.poolfile.PoolFileMedium`: the node on this host,
  straight through its mapped pool file; it alone also loads layer by layer
  (:mod:`.layerwise`), which needs the blocks in this host's memory.

The worker asks them in order (the pool file first, when there is one): a load's blocks
go to the first medium that takes them, a save to the first medium that accepts it.  A
new medium (a disk tier) is one new module implementing :class:`Medium`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..metadata import LoadJob, SaveJob

BREAKER_OPEN = "saves are failing, so they are paused for a while (circuit breaker)"
"""why saves are dropped while the save breaker is open"""


@dataclass
class LoadResult:
    """What a medium made of a load (or a probe): for the worker's books."""

    handled: set[int] = field(default_factory=set)
    """indexes of the job's blocks it handled (loaded or failed): later media skip them"""
    ok: set[int] = field(default_factory=set)
    """indexes of the blocks loaded and verified"""
    samples: list[tuple[str, int, float]] = field(default_factory=list)
    """(source, bytes, seconds) of each source it loaded from, for the cost model"""
    counts: list[tuple[str, float]] = field(default_factory=list)
    """counters to add, in order (:mod:`pegaflow.connector.metrics`)"""

    def count(self, name: str, value: float = 1) -> None:
        """Note ``value`` for counter ``name`` (the worker's books add it)."""
        self.counts.append((name, value))


@dataclass
class SaveResult:
    """A save's answer: the blocks ``hashes`` sent at ``started`` (of blocks filled at
    ``filled_at``), answered ``reply`` (``stored``/``skipped``/``failed`` counts) or
    ``error``."""

    hashes: list[bytes]
    started: float
    filled_at: float
    reply: Any = None
    error: BaseException | None = None

    def take(self, fut: concurrent.futures.Future[Any]) -> None:
        """Take the answer of the (done) future ``fut``."""
        try:
            self.reply = fut.result()
        except Exception as e:
            self.error = e


class SaveSink(Protocol):
    """What a medium asks of the worker while it saves, and where answers go."""

    def allow(self) -> bool:
        """Whether saves may go now (the save breaker is closed)."""
        ...

    def drop(self, jobs: list[SaveJob], why: str) -> None:
        """Blocks not saved, and why."""
        ...

    def hold_until_taken(self, req_ids: list[str], filled_at: float) -> Callable[[], None]:
        """Hold these requests' blocks from reuse until the callback returned is called."""
        ...

    def sent(self, n: int, copy_s: float) -> None:
        """``n`` blocks went out (their answer is pending), after ``copy_s`` seconds of
        copying them out of the KV cache."""
        ...

    def answered(self, result: SaveResult) -> None:
        """A save was answered (stored, or failed)."""
        ...


class Medium(Protocol):
    """One way of moving blocks (see the module docstring)."""

    name: str

    def load(self, client: Any, ns: str, job: LoadJob, skip: set[int]) -> LoadResult:
        """Load the blocks of ``job`` this medium serves, except those in ``skip``, on
        the calling (load) thread; returns what became of them."""
        ...

    def submit_save(
        self, client: Any, ns: str, job: SaveJob, marker: Any, sink: SaveSink
    ) -> bool:
        """Start saving ``job`` (blocks copied out, then sent; the answers go to
        ``sink``); False when this medium cannot take it now (the next one is asked)."""
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
