"""Lock-free Prometheus counters and histograms for hot paths.

prometheus_client's own ``Counter.labels(...).inc()`` takes locks and costs about 3 µs
on the development machines, which on a data path of small blocks or a lookup of a few
microseconds is several percent.  :class:`FastCounter` and :class:`FastHistogram` are
plain numbers updated without locks and read by :meth:`collect` at scrape time, with
the same names, types, labels and API (``.labels(...).inc()``, ``.observe()``).

Each instance must be updated from one thread only (an event loop); a scrape from
another thread reads the numbers as they are, which at worst misses an update in
flight.  Pass ``registry`` to register the metric, or yield from :meth:`collect` in a
collector of your own.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector


class CounterChild:
    """One label set of a :class:`FastCounter`."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` (>= 0)."""
        self.value += amount


class HistogramChild:
    """One label set of a :class:`FastHistogram`: per-bucket counts (not cumulative;
    the last one is ``+Inf``) and the sum."""

    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Record one value: a bisect and two adds."""
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count)`` pairs as a Prometheus histogram exposes them."""
        acc = 0
        out: list[tuple[str, float]] = []
        for bound, c in zip((*self.buckets, float("inf")), self.counts, strict=True):
            acc += c
            out.append(("+Inf" if bound == float("inf") else repr(bound), acc))
        return out


_Child = TypeVar("_Child", CounterChild, HistogramChild)


class _FastMetric(Collector, Generic[_Child]):
    """The label handling shared by both kinds.  An unlabelled metric has one child,
    ``_solo``, from the start (so it is exposed as zero before its first update, as
    prometheus_client's own metrics are); a labelled one creates a child per label set
    on first use."""

    def __init__(
        self, name: str, doc: str, labelnames: tuple[str, ...] | list[str],
        registry: CollectorRegistry | None,
    ) -> None:  # fmt: skip
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _Child] = {}
        self._solo: _Child | None = None if self.labelnames else self._new_child()
        self._single = len(self.labelnames) == 1
        self._first = self.labelnames[0] if self.labelnames else ""
        if registry is not None:
            registry.register(self)

    @abstractmethod
    def _new_child(self) -> _Child: ...

    def labels(self, *values: str, **kw: str) -> _Child:
        """The child of one label set (created on first use)."""
        if kw:
            key = (kw[self._first],) if self._single else tuple(kw[n] for n in self.labelnames)
        else:
            key = values
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self.labelnames) or not key:
                raise ValueError(f"{self.name}: labels {self.labelnames} expected")
            child = self._children[key] = self._new_child()
        return child

    def _all(self) -> list[tuple[tuple[str, ...], _Child]]:
        """Every child with its label values, the unlabelled one first."""
        solo = [((), self._solo)] if self._solo is not None else []
        return solo + list(self._children.items())


class FastCounter(_FastMetric[CounterChild]):
    """A lock-free counter for one thread, exposed as a Prometheus counter ``name``
    (``name_total``).  Same API as ``prometheus_client.Counter`` for ``inc`` and
    ``labels``."""

    def __init__(
        self, name: str, doc: str, labelnames: tuple[str, ...] | list[str] = (), *,
        registry: CollectorRegistry | None = None,
    ) -> None:  # fmt: skip
        super().__init__(name, doc, labelnames, registry)

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` to an unlabelled counter."""
        assert self._solo is not None, f"{self.name} has labels; use .labels(...)"
        self._solo.value += amount

    @property
    def value(self) -> float:
        """The value of an unlabelled counter."""
        assert self._solo is not None, f"{self.name} has labels; use .labels(...)"
        return self._solo.value

    def collect(self) -> Iterator[Any]:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, child in self._all():
            fam.add_metric(list(key), child.value, created=child.created)
        yield fam

    def describe(self) -> Iterator[Any]:
        yield CounterMetricFamily(self.name, self.doc, labels=self.labelnames)


class FastHistogram(_FastMetric[HistogramChild]):
    """A lock-free histogram for one thread, exposed as a Prometheus histogram ``name``
    (``_bucket``, ``_sum``, ``_count``) with upper bounds ``buckets`` (ascending; the
    ``+Inf`` bucket is added).  Same API as ``prometheus_client.Histogram`` for
    ``observe`` and ``labels``."""

    def __init__(
        self, name: str, doc: str, labelnames: tuple[str, ...] | list[str] = (), *,
        buckets: tuple[float, ...],
        registry: CollectorRegistry | None = None,
    ) -> None:  # fmt: skip
        self.bucket_bounds = tuple(float(b) for b in buckets)
        super().__init__(name, doc, labelnames, registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bucket_bounds)

    def observe(self, value: float) -> None:
        """Record one value in an unlabelled histogram."""
        solo = self._solo
        assert solo is not None, f"{self.name} has labels; use .labels(...)"
        solo.counts[bisect_left(solo.buckets, value)] += 1  # HistogramChild.observe, inlined
        solo.sum += value

    def collect(self) -> Iterator[Any]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, child in self._all():
            fam.add_metric(list(key), child.cumulative(), child.sum)
        yield fam

    def describe(self) -> Iterator[Any]:
        yield HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
