"""The connector's counters in vLLM's connector-stats and Prometheus plumbing.

vLLM collects :class:`PegaConnectorStats` from the scheduler and every worker each
step, aggregates them (sum), logs them as ``KV Transfer metrics: ...`` when stats
logging is on, and feeds them to :class:`PegaPromMetrics`, which exports
``vllm:pegaflow_<counter>_total`` on vLLM's own ``/metrics`` endpoint.
"""

from __future__ import annotations

from typing import Any

from .compat import KVConnectorPromMetrics, KVConnectorStats
from .metrics import COUNTERS


class PegaConnectorStats(KVConnectorStats):
    """Counter deltas (``data``: counter name -> value) of one interval."""

    def reset(self) -> None:
        """Clear all counters."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> PegaConnectorStats:
        """Sum ``other``'s counters into this object (and return it)."""
        for k, v in (other.data or {}).items():
            if isinstance(v, int | float):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's totals plus derived ratios, for vLLM's periodic log line."""
        d = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.data.items()}
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
    """``vllm:pegaflow_<counter>`` Prometheus counters, one series per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series: dict[tuple[int, str], Any] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(
                name=f"vllm:pegaflow_{name}", documentation=doc, labelnames=labelnames
            )
            for engine_idx, values in per_engine_labelvalues.items():
                self._series[(engine_idx, name)] = metric.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counters."""
        for name, value in transfer_stats_data.items():
            series = self._series.get((engine_idx, name))
            if series is not None and isinstance(value, int | float) and value > 0:
                series.inc(value)
