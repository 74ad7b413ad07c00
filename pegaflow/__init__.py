"""PegaFlow cluster: an external, shared KV cache for vLLM.

Subpackages: :mod:`pegaflow.coordinator` (global index service),
:mod:`pegaflow.storage_node` (block storage over UCX), :mod:`pegaflow.client`
(async/sync client library) and :mod:`pegaflow.connector` (vLLM ``PegaKVConnector``).
Shared code here: wire protocol, config, keys, errors.
"""

__version__ = "0.1.0"
