"""Client library of PegaFlow: lookups via the coordinator, blocks from the nodes over UCX.

Use :class:`PegaClient` from asyncio code and :class:`SyncPegaClient` elsewhere.
"""

from .api import GetItem, LookupResult, PegaClient, PutItem, PutResult, SyncPegaClient

__all__ = ["GetItem", "LookupResult", "PegaClient", "PutItem", "PutResult", "SyncPegaClient"]
