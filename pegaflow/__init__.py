"""PegaFlow cluster: an external, shared KV cache for vLLM.

Subpackages: :mod:`pegaflow.coordinator` (global index service),
:mod:`pegaflow.storage_node` (block storage over UCX), :mod:`pegaflow.client`
(async/sync client library) and :mod:`pegaflow.connector` (vLLM ``PegaKVConnector``).
Shared code here: wire protocol, config, keys, errors.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pegaflow-cluster")
    """the installed distribution's version: pyproject.toml's ``version``, its one source"""
except PackageNotFoundError:  # a checkout on sys.path that was never installed
    __version__ = "0+unknown"
