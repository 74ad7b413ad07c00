"""A step's load errors, checked when vLLM's scheduler reads them.

A step with layer-wise loads must report the blocks that failed their check in that
step's output (``get_block_ids_with_load_errors``): vLLM then discards what the step
computed from them and recomputes.  Checking means waiting for the step's copies, and
vLLM asks at the end of ``execute_model``, so the engine's CPU would wait there for
every copy of the step.  With asynchronous scheduling (vLLM 0.26's default) the
scheduler reads a step's output only after it has scheduled and launched the next
step; when the worker shares the scheduler's process (one rank, the ``uni`` executor),
the answer can be a :class:`DeferredLoadErrors` that checks when it is first read.  The
next step's copies are then queued while this step's still run, and a batch of hits
that vLLM splits over several steps copies without a gap.

vLLM reads the answer as a set: truth value, membership, iteration, and ``agg |= x``
in ``MultiConnector`` (which, ``x`` being no ``set``, lands in :meth:`__ror__` and
checks at once).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet

__all__ = ["DeferredLoadErrors", "defer_possible"]


class DeferredLoadErrors(AbstractSet[int]):
    """Block ids that failed to load in one step, computed on first read.

    Args:
        check: waits for the step's copies, verifies them and returns the failed block
            ids; called once, by whoever reads first (vLLM's scheduler, or the worker
            when vLLM did not read it in time, see :meth:`WorkerSide.take_load_errors`).
    """

    def __init__(self, check: Callable[[], set[int]]) -> None:
        self._check: Callable[[], set[int]] | None = check
        self._ids: set[int] = set()
        self._lock = threading.Lock()
        self.read_first_by_vllm = True
        """False when the worker had to check it before vLLM read it"""

    @property
    def checked(self) -> bool:
        """Whether the check has run."""
        return self._check is None

    def resolve(self) -> set[int]:
        """Run the check (once) and return the failed block ids."""
        with self._lock:
            if self._check is not None:
                check, self._check = self._check, None
                self._ids = check()
            return self._ids

    @classmethod
    def _from_iterable(cls, it: Iterable[int]) -> set[int]:
        return set(it)

    def __contains__(self, x: object) -> bool:
        return x in self.resolve()

    def __iter__(self) -> Iterator[int]:
        return iter(self.resolve())

    def __len__(self) -> int:
        return len(self.resolve())

    def __bool__(self) -> bool:
        return bool(self.resolve())

    def __repr__(self) -> str:
        if not self.checked:
            return "DeferredLoadErrors(<not checked yet>)"
        return f"DeferredLoadErrors({sorted(self._ids)})"


def defer_possible(vllm_config: object) -> bool:
    """Whether load errors can be answered deferred: the worker runs in the scheduler's
    process (the ``uni`` executor: one rank), so the answer reaches the scheduler as
    the object itself, never serialized.  (Without asynchronous scheduling vLLM reads
    it right after the step, so deferring costs nothing there.)"""
    parallel = getattr(vllm_config, "parallel_config", None)
    return getattr(parallel, "distributed_executor_backend", None) == "uni"
