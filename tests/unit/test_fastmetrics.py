"""Unit tests of pegaflow.observability.fastmetrics (pure logic): the lock-free metrics expose what
prometheus_client's own Counter and Histogram expose for the same updates."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from pegaflow.observability.fastmetrics import FastCounter, FastHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _samples(registry: CollectorRegistry) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    """Every sample but the ``_created`` timestamps."""
    return {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for fam in registry.collect()
        for s in fam.samples
        if not s.name.endswith("_created")
    }


def test_counters_expose_as_prometheus_client_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast_solo = FastCounter("t_solo", "doc", registry=ours)
    fast_lab = FastCounter("t_lab", "doc", ["op", "code"], registry=ours)
    ref_solo = Counter("t_solo", "doc", registry=theirs)
    ref_lab = Counter("t_lab", "doc", ["op", "code"], registry=theirs)
    assert _samples(ours) == _samples(theirs)  # unlabelled: 0 before the first inc
    for solo, lab in ((fast_solo, fast_lab), (ref_solo, ref_lab)):
        solo.inc()
        solo.inc(2.5)
        lab.labels("get", "quota").inc()
        lab.labels(op="get", code="quota").inc(4)
        lab.labels(op="put", code="internal").inc()
    assert _samples(ours) == _samples(theirs)
    assert fast_solo.value == 3.5


def test_histograms_expose_as_prometheus_client_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast_solo = FastHistogram("h_solo", "doc", buckets=BUCKETS, registry=ours)
    fast_lab = FastHistogram("h_lab", "doc", ["op"], buckets=BUCKETS, registry=ours)
    ref_solo = Histogram("h_solo", "doc", buckets=BUCKETS, registry=theirs)
    ref_lab = Histogram("h_lab", "doc", ["op"], buckets=BUCKETS, registry=theirs)
    assert _samples(ours) == _samples(theirs)  # unlabelled: zero buckets from the start
    for solo, lab in ((fast_solo, fast_lab), (ref_solo, ref_lab)):
        for v in (0.0005, 0.001, 0.05, 0.5, 7.0):  # 0.001: on a bound, counted in it
            solo.observe(v)
            lab.labels("get").observe(v / 10)
            lab.labels(op="put").observe(v)
    assert _samples(ours) == _samples(theirs)


def test_label_mistakes_are_refused() -> None:
    c = FastCounter("c", "doc", ["op"])
    h = FastHistogram("h", "doc", ["op"], buckets=BUCKETS)
    for m in (c, h):
        with pytest.raises(ValueError):
            m.labels("a", "b")
        with pytest.raises(ValueError):
            m.labels()
    with pytest.raises(ValueError):
        FastCounter("u", "doc").labels()
    with pytest.raises(AssertionError):
        c.inc()
    with pytest.raises(AssertionError):
        h.observe(1.0)
