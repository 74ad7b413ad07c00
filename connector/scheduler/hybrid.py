"""Which blocks of a hybrid model are stored, looked up and loaded (sliding windows).

Under vLLM's hybrid KV cache manager each token block of a request (a *position*) has
one block per KV cache group, stored under that group's key
(:func:`~pegaflow.connector.namespace.group_keys`).  A full-attention group's blocks
are all needed, so every position is stored.  Attention in a sliding-window group reads
only the window before a token, so a hit ending at position ``L`` needs that group's
blocks of positions ``[L - n, L)``, ``n = cdiv(window - 1, block_size)`` (vLLM's own
rule: it gives the positions before them its null block), and nothing else.  A window
group's blocks are therefore stored only in the window before each *end* a later hit
can use: where a request's saves stop in a step (its last full block so far, the end
of its prompt), and every ``anchor`` positions, so that a prompt sharing a prefix that
ends between a request's save points (another question on the same document) still
hits up to the last anchor before it.  What a request stores of a window group is then
bounded by its windows, not its length.

A *state* group (Mamba, linear attention) holds at a position the recurrent state after
its last token: a hit ending at ``L`` needs that group's block of position ``L - 1`` and
nothing else, a window of one block.  vLLM keeps such a state only at the block
boundaries where a step of its request ended (``mamba_cache_mode`` ``align``) and names
each one's block to the connector as it commits it, so a state group's blocks are stored
where vLLM says, never by the window rule above.

A lookup asks the full groups' keys first (one prefix lookup: the longest run of
positions all of them have), then the window and state groups' keys before the best end
found: that end, else (state groups) each of the ``state_probes - 1`` positions before it,
else the last anchor before it.

Pure module: no vLLM import, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Slot = tuple[int, int]
"""(position, group): one stored block"""


@dataclass(frozen=True)
class GroupLayout:
    """A hybrid model's KV cache groups, as the storage rule sees them.

    Args:
        windows: per group, the blocks of its window (0: full attention).
        anchor: positions between the anchors where window groups are also stored
            (0: none, only where saves stop).
    """

    windows: tuple[int, ...]
    anchor: int = 0
    states: tuple[bool, ...] = ()
    """per group: a state group (its window is one block)"""
    state_probes: int = 4
    """ends a lookup tries for a layout with state groups"""

    @classmethod
    def of(
        cls,
        window_tokens: Sequence[int],
        block_size: int,
        anchor_tokens: int,
        states: Sequence[bool] = (),
    ) -> GroupLayout:
        """From each group's sliding window in tokens (0: none) and whether it is a state
        group."""
        st = tuple(bool(x) for x in states) or (False,) * len(window_tokens)
        return cls(
            tuple(
                1 if s else -(-(w - 1) // block_size) if w else 0
                for w, s in zip(window_tokens, st, strict=True)
            ),
            max(0, anchor_tokens // block_size),
            st if any(st) else (),
        )

    @property
    def groups(self) -> int:
        """KV cache groups."""
        return len(self.windows)

    @property
    def full(self) -> list[int]:
        """The full-attention groups."""
        return [g for g, n in enumerate(self.windows) if not n]

    @property
    def windowed(self) -> list[int]:
        """The sliding-window and state groups (vLLM frees their blocks while a request
        runs)."""
        return [g for g, n in enumerate(self.windows) if n]

    def is_state(self, group: int) -> bool:
        """Whether ``group`` is a state group."""
        return bool(self.states) and self.states[group]

    def key(self, keys: Sequence[bytes], slot: Slot) -> bytes:
        """The storage key of ``slot`` among a request's interleaved keys."""
        return keys[slot[0] * self.groups + slot[1]]

    def full_slots(self, start: int, end: int) -> list[Slot]:
        """The full groups' blocks of positions ``[start, end)``, position by position."""
        return [(p, g) for p in range(start, end) for g in self.full]

    def window_slots(self, start: int, end: int) -> list[Slot]:
        """The window groups' blocks a hit ending at ``end`` needs, of positions from
        ``start`` on (those before are vLLM's own)."""
        return [
            (p, g)
            for p in range(max(start, end - max(self.windows)), end)
            for g in self.windowed
            if p >= end - self.windows[g]
        ]

    def ends(self, start: int, end: int) -> list[int]:
        """Where a hit of positions ``(start, end]`` may end, best first: ``end``, then
        (state groups) the positions just before it, then the last anchor before it."""
        probes = self.state_probes if self.states else 1
        out = list(range(end, max(start, end - probes), -1))
        if self.anchor:
            a = (end - 1) // self.anchor * self.anchor
            if a > start and a not in out:
                out.append(a)
        return out

    def save_slots(self, lo: int, full: int) -> list[Slot]:
        """The blocks to store of positions ``[lo, full)`` newly computed by a step: every
        full group's; a window group's in the window before ``full`` and before each
        anchor in ``(lo, full]`` (its blocks before ``lo`` were stored by earlier steps,
        as far as any window needs them); no state group's (vLLM names those)."""
        slots = set(self.full_slots(lo, full))
        ends = [full]
        if self.anchor:
            ends += range(-(-(lo + 1) // self.anchor) * self.anchor, full, self.anchor)
        for end in ends:
            slots.update(s for s in self.window_slots(lo, end) if not self.is_state(s[1]))
        return sorted(slots)
