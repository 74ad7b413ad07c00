"""Client library of PegaFlow: lookups via the coordinator, blocks from the nodes over UCX.

Use :class:`PegaClient` from asyncio code and :class:`SyncPegaClient` elsewhere.
"""

from pegaflow.protocol.coordinator import LookupResult

from .api import GetItem, PegaClient, PutItem, PutResult
from .samehost import LocalNode, on_this_host, open_pool_file
from .sync import SyncPegaClient

__all__ = [
    "GetItem",
    "LocalNode",
    "LookupResult",
    "PegaClient",
    "PutItem",
    "PutResult",
    "SyncPegaClient",
    "on_this_host",
    "open_pool_file",
]
