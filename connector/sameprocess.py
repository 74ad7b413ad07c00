"""The worker that shares the scheduler's process, so a step's loads can start early.

With one rank vLLM runs its worker in the engine core's process (the ``uni`` executor,
:func:`~.loadcheck.defer_possible`), and with asynchronous scheduling it schedules step
N + 1 while step N runs on the GPU.  The scheduler's connector then hands each load to
the worker the moment vLLM allocates its blocks
(:meth:`~.worker.side.WorkerSide.prestart_job`, started there where vLLM replays CUDA
graphs) and each plan the moment it is built (:meth:`~.worker.side.WorkerSide.prestart`), so
the copies of a step's layer-wise loads start before vLLM launches its forward pass;
that launch comes after the scheduler has answered the other requests' lookups and vLLM
has prepared the inputs.
"""

from __future__ import annotations

from typing import Any, Protocol

from .metadata import LoadJob, StepPlan
from .metrics import Counters


class SameProcessWorker(Protocol):
    """What the scheduler of this process uses of its worker
    (:class:`~pegaflow.connector.worker.side.WorkerSide`)."""

    counters: Counters

    @property
    def client(self) -> Any:
        """The worker's cluster client (None before it is made)."""
        ...

    def prestart(self, plan: StepPlan) -> None:
        """Queue a planned step's layer-wise loads early."""
        ...

    def prestart_job(self, job: LoadJob, ns: str) -> None:
        """Queue one request's layer-wise load the moment its blocks are allocated."""
        ...


_worker: SameProcessWorker | None = None


def register(worker: SameProcessWorker) -> None:
    """Make ``worker`` this process's worker (its KV cache is registered)."""
    global _worker
    _worker = worker


def unregister(worker: SameProcessWorker) -> None:
    """Forget ``worker`` (it is shutting down)."""
    global _worker
    if _worker is worker:
        _worker = None


def worker() -> SameProcessWorker | None:
    """This process's worker, when the scheduler shares its process."""
    return _worker


def worker_totals() -> dict[str, float] | None:
    """The cumulative counters of this process's worker (None: no worker here)."""
    w = _worker
    return w.counters.totals() if w is not None else None
