"""What the scheduler side keeps per request: its lookup's answer and its bookkeeping.

Pure module: no vLLM import (requests are duck-typed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pegaflow.protocol.codec import LocatedBlocks

from ..handoff import Handoff


@dataclass
class Lookup:
    """One lookup's answer for a request, as far as it is claimed."""

    at: float
    start: int
    n_hashes: int
    hits: int
    nodes: list[list[str]]
    sync: bool = False
    gens: list[list[int]] = field(default_factory=list)
    """per hit block, the generation of each shard when the lookup saw it (fencing)"""
    disk: list[bool] = field(default_factory=list)
    """per hit block, whether it is only on its node's disk tier (empty: all in memory)"""
    located: list[LocatedBlocks] = field(default_factory=list)
    """per shard: where the hit blocks are in the local node's pool file (see
    :attr:`LoadJob.located`); empty when the blocks were not located"""
    pins: list[int] = field(default_factory=list)
    """per shard, the local node's pin on the located blocks"""
    located_at: float = 0.0
    slots: list[tuple[int, int]] = field(default_factory=list)
    """a hybrid model's hit: the (position, group) of each block of ``nodes`` (empty:
    one group, block ``i`` is position ``start + i``); ``hits`` then counts positions"""


@dataclass
class ReqState:
    """A request the scheduler side tracks, from its first lookup until it finishes."""

    request: Any
    block_ids: list[list[int]] = field(default_factory=list)
    """per KV cache group, the request's block ids as vLLM allocated them"""
    next_save: int = 0
    """the first block (position) not yet planned for saving"""
    keys: list[bytes] = field(default_factory=list)
    """the storage keys of the request's block hashes so far (see :meth:`Planner.keys`)"""
    lookup: Lookup | None = None
    loading: bool = False
    saved_any: bool = False
    started_ns: int = field(default_factory=time.time_ns)  # root span of its trace
    handoff: Handoff | None = None
    """a producer's handoff this request still waits for (see
    :meth:`~.handoffwait.HandoffWait.wait`)"""
    handoff_read: bool = False
    handoff_until: float = 0.0
    handoff_poll: float = 0.0


def per_group(block_ids: Any, groups: int) -> list[list[int]]:
    """vLLM's per-group block-id tuple as ``groups`` lists (an older vLLM's flat list
    is the only group's)."""
    if not block_ids:
        return [[] for _ in range(groups)]
    first = block_ids[0]
    if isinstance(first, list | tuple):
        out = [list(b) for b in block_ids[:groups]]
        return out + [[] for _ in range(groups - len(out))]
    return [list(block_ids)] + [[] for _ in range(groups - 1)]
