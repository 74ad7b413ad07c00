"""Who may talk to a service, and which namespaces a tenant may touch.

``[security] token`` is the cluster secret: a connection presenting it may use every
namespace.  ``[security] tenant_tokens`` (``"tenant=secret"`` items) admits tenants: a
connection presenting a tenant's secret may only use namespaces that start with
``"<tenant>@"``, so one tenant can neither read nor write another's blocks.  With
neither set, connections are not authenticated (a single trusted host).  Both may come
from files instead (``token_file``, ``tenant_tokens_file``): :func:`cluster_token` and
:func:`tenant_tokens` are where they are read.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from collections.abc import Sequence
from typing import Any

from pegaflow.config import ConfigError, SecurityConfig
from pegaflow.errors import Unauthorized

log = logging.getLogger(__name__)

TENANT_SEP = "@"


def warn_if_shared(path: str, option: str) -> None:
    """Warn when others than its owner may read the secret file ``path`` (the option
    that names it, e.g. ``[security] token_file``); say nothing of a file that cannot be
    stat'ed (its reader fails)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return
    if mode & 0o077:
        log.warning(
            "%s: %s has mode %o: others than its owner may read the secret "
            "(chmod 600 %s)", option, path, mode, path,
        )  # fmt: skip


def _read_secrets(path: str, option: str) -> list[str]:
    """The lines of a secrets file (blank and ``#`` lines left out)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = [ln.strip() for ln in fh]
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(option, f"cannot read {path}: {e}") from None
    warn_if_shared(path, option)
    return [ln for ln in lines if ln and not ln.startswith("#")]


def secret(value: str, path: str, option: str) -> str | None:
    """A secret given as ``value`` or as the first line of the file ``path``, not both
    (``option``: ``[section] name``, for errors; None: neither)."""
    if not path:
        return value or None
    if value:
        raise ConfigError(f"{option}/{option.split()[-1]}_file", "set one of them, not both")
    lines = _read_secrets(path, f"{option}_file")
    if not lines:
        raise ConfigError(f"{option}_file", f"{path} holds no {option.split()[-1]}")
    return lines[0]


def cluster_token(sec: SecurityConfig) -> str | None:
    """The cluster token: ``token``, or the first line of ``token_file`` (None: none)."""
    return secret(sec.token, sec.token_file, "[security] token")


def tenant_tokens(sec: SecurityConfig) -> list[str]:
    """The ``tenant=secret`` items: ``tenant_tokens``, or the lines of
    ``tenant_tokens_file``."""
    if not sec.tenant_tokens_file:
        return list(sec.tenant_tokens)
    if sec.tenant_tokens:
        raise ConfigError(
            "[security] tenant_tokens/tenant_tokens_file", "set one of them, not both"
        )
    return _read_secrets(sec.tenant_tokens_file, "[security] tenant_tokens_file")


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


def authenticator(sec: SecurityConfig) -> Authenticator:
    """The check of the tokens ``sec`` names (read from their files, if any)."""
    return Authenticator(cluster_token(sec), tenant_tokens(sec))
