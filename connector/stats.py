"""The connector's counters in vLLM's connector-stats and Prometheus plumbing.

vLLM collects :class:`PegaConnectorStats` from the scheduler and every worker each
step, aggregates them (counters summed, durations concatenated), logs them as
``KV Transfer metrics: ...`` when stats logging is on, and feeds them to
:class:`PegaPromMetrics`, which exports them on vLLM's own ``/metrics`` endpoint:
``vllm:pegaflow_<counter>_total`` for every entry of :data:`.metrics.COUNTERS` (those of
a labelled family, :data:`.metrics.LABELLED`, as one counter with a label) and
``vllm:pegaflow_<histogram>`` for every entry of :data:`.metrics.HISTOGRAMS`.
"""

from __future__ import annotations

from typing import Any

from .compat import KVConnectorPromMetrics, KVConnectorStats
from .metrics import COUNTERS, HISTOGRAMS, LABEL_VALUES, LABELLED, LATENCY_BUCKETS, MAX_SAMPLES

_HISTOGRAM_NAMES = frozenset(name for name, _doc in HISTOGRAMS.values())


class PegaConnectorStats(KVConnectorStats):
    """One interval's ``data``: counter name -> delta, histogram name -> durations."""

    def reset(self) -> None:
        """Clear all counters."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> PegaConnectorStats:
        """Sum ``other``'s counters into this object and append its durations (at most
        :data:`.metrics.MAX_SAMPLES` per histogram); return this object."""
        for k, v in (other.data or {}).items():
            if isinstance(v, int | float):
                self.data[k] = self.data.get(k, 0) + v
            elif k in _HISTOGRAM_NAMES and isinstance(v, list):
                mine = self.data.setdefault(k, [])
                mine.extend(v[: max(0, MAX_SAMPLES - len(mine))])
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's totals plus derived ratios, for vLLM's periodic log line."""
        d = {
            k: (round(v, 4) if isinstance(v, float) else v)
            for k, v in self.data.items()
            if isinstance(v, int | float)
        }
        hit = self.data.get("lookup_hit_blocks", 0)
        miss = self.data.get("lookup_miss_blocks", 0)
        if hit + miss:
            d["hit_rate"] = round(hit / (hit + miss), 4)
        if self.data.get("load_seconds") and self.data.get("load_bytes"):
            d["load_GBps"] = round(self.data["load_bytes"] / self.data["load_seconds"] / 1e9, 3)
        return d

    def is_empty(self) -> bool:
        """True when nothing was counted."""
        return not any(self.data.values())


class PegaPromMetrics(KVConnectorPromMetrics):
    """``vllm:pegaflow_<counter>`` counters and ``vllm:pegaflow_<histogram>`` latency
    histograms, one series per engine (vLLM builds it through
    ``PegaKVConnector.build_prom_metrics``).

    Args:
        vllm_config: engine configuration.
        metric_types: Prometheus metric classes vLLM wants used.
        labelnames: label names of every series.
        per_engine_labelvalues: label values per engine index.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series: dict[tuple[int, str], Any] = {}
        labelled = {f"{f}.{v}" for f, values in LABEL_VALUES.items() for v in values}
        for name, doc in COUNTERS.items():
            if name in labelled:
                continue
            metric = self._counter_cls(
                name=f"vllm:pegaflow_{name}", documentation=doc, labelnames=labelnames
            )
            for engine_idx, values in per_engine_labelvalues.items():
                self._series[(engine_idx, name)] = metric.labels(*values)
        for family, (label, doc) in LABELLED.items():
            metric = self._counter_cls(
                name=f"vllm:pegaflow_{family}",
                documentation=doc,
                labelnames=[*labelnames, label],
            )
            for engine_idx, values in per_engine_labelvalues.items():
                for v in LABEL_VALUES[family]:
                    self._series[(engine_idx, f"{family}.{v}")] = metric.labels(*values, v)
        for name, doc in HISTOGRAMS.values():
            metric = self._histogram_cls(
                name=f"vllm:pegaflow_{name}",
                documentation=doc,
                buckets=list(LATENCY_BUCKETS),
                labelnames=labelnames,
            )
            for engine_idx, values in per_engine_labelvalues.items():
                self._series[(engine_idx, name)] = metric.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counters and observe its durations."""
        for name, value in transfer_stats_data.items():
            series = self._series.get((engine_idx, name))
            if series is None:
                continue
            if name in _HISTOGRAM_NAMES:
                if isinstance(value, list):
                    for v in value:
                        if isinstance(v, int | float):
                            series.observe(v)
            elif isinstance(value, int | float) and value > 0:
                series.inc(value)
