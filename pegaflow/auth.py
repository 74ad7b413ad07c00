"""Who may talk to a service, and which namespaces a tenant may touch.

``[security] token`` is the cluster secret: a connection presenting it may use every
namespace.  ``[security] tenant_tokens`` (``"tenant=secret"`` items) admits tenants: a
connection presenting a tenant's secret may only use namespaces that start with
``"<tenant>@"``, so one tenant can neither read nor write another's blocks.  With
neither set, connections are not authenticated (a single trusted host).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Any

from pegaflow.errors import Unauthorized

TENANT_SEP = "@"


class Authenticator:
    """Checks a handshake's token; returns the connection's tenant (None: all access)."""

    def __init__(self, token: str | None = None, tenant_tokens: Sequence[str] = ()) -> None:
        self._token = token or None
        self._tenants: list[tuple[str, str]] = []
        for item in tenant_tokens:
            tenant, sep, secret = item.partition("=")
            if not sep or not tenant or not secret or TENANT_SEP in tenant:
                raise ValueError(f"tenant token {tenant!r} must look like 'tenant=secret'")
            self._tenants.append((tenant, secret))

    def cluster_only(self) -> Authenticator:
        """The same check admitting the cluster token alone (no tenant)."""
        return Authenticator(self._token)

    @property
    def required(self) -> bool:
        """Whether connections must present a token at all."""
        return self._token is not None or bool(self._tenants)

    def authenticate(self, token: Any) -> str | None:
        """The tenant of ``token`` (None for the cluster token or an open service)."""
        if not self.required:
            return None
        if isinstance(token, str):
            if self._token is not None and hmac.compare_digest(token, self._token):
                return None
            for tenant, secret in self._tenants:
                if hmac.compare_digest(token, secret):
                    return tenant
        raise Unauthorized("missing or wrong token")


def check_access(ns: Any, tenant: str | None) -> None:
    """Refuse a namespace outside the connection's tenant."""
    if tenant is not None and (not isinstance(ns, str) or not ns.startswith(tenant + TENANT_SEP)):
        raise Unauthorized(f"tenant {tenant!r} may only use namespaces '{tenant}{TENANT_SEP}...'")
