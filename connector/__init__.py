"""vLLM connector of PegaFlow: ``PegaKVConnector``.

Use it exactly as the public PegaFlow documents::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PegaKVConnector",
      "kv_role": "kv_both", "kv_connector_module_path": "pegaflow.connector"}'

vLLM imports this package and reads its ``PegaKVConnector`` attribute.  The
``vllm.general_plugins`` entry point (:mod:`.plugin`) also registers the name with vLLM,
so ``{"kv_connector": "PegaKVConnector"}`` alone works too (as a ``MultiConnector``
child).  The class (and vLLM with it) is imported on first access, so the pure helpers
(:mod:`.settings`, :mod:`.namespace`, :mod:`.scheduler.side`) stay importable without vLLM.
See ``docs/connector.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import PegaKVConnector
    from .stats import PegaConnectorStats

__all__ = ["PegaConnectorStats", "PegaKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "PegaKVConnector":
        from .connector import PegaKVConnector

        return PegaKVConnector
    if name == "PegaConnectorStats":
        from .stats import PegaConnectorStats

        return PegaConnectorStats
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
