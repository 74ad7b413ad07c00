"""A ``pegaflow-server`` with a cluster token and one tenant, and clients of it."""

from __future__ import annotations

from pegaflow.client import SyncPegaClient

from pegaflow.config import ClientConfig
from pegaflow.tools.devcluster import Proc, start_server

ADMIN = "admin"
"""the cluster token"""
TENANT = ("acme", "a-secret")
"""a tenant and its token"""


def tenant_server(pool: str) -> Proc:
    """The server, with a node pool of ``pool`` bytes (e.g. ``"32MiB"``); its hello
    deadline is generous, as a loaded machine may take seconds to connect."""
    return start_server(
        token=ADMIN,
        tenants=f"{TENANT[0]}={TENANT[1]}",
        extra=["--node-pool-bytes", pool, "--node-slab-bytes", "4MiB",
               "--node-hello-timeout-s", "60"],
    )  # fmt: skip


def client_of(server: Proc, token: str = ADMIN) -> SyncPegaClient:
    """A client of ``server`` with ``token`` (deadlines that bound a hang on a loaded machine)."""
    cfg = ClientConfig(
        coordinators=[server.ready["coordinator"]], lookup_timeout_s=10, rpc_timeout_s=30,
        transfer_timeout_s=60,
    )  # fmt: skip
    return SyncPegaClient(cfg, token=token)
