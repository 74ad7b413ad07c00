"""TLS of ``[security]``: the SSL contexts of this process's servers and clients.

``tls_cert`` and ``tls_key`` make the control protocol's TCP servers and the HTTP
endpoints speak TLS (1.2 or later); ``tls_ca`` makes every client here (the RPC clients,
blocking or not, and the HTTP requests to our endpoints) speak TLS and verify the
server's certificate and its name or address.  Neither set: plain TCP, as before.  A
Unix socket (the node's same-host control socket) stays plain: only its owner (or
``access_group``) may open it.  UCX's transports are not covered (docs/operations.md,
"Security").
"""

from __future__ import annotations

import ssl

from pegaflow.auth import warn_if_shared
from pegaflow.config import ConfigError, SecurityConfig

NOT_ANSWERED = (
    "closed before answering the hello (a TLS server? a client needs [security] tls_ca)"
)
"""why a plain client's connection closed at its hello may be: a TLS server reads
the hello as a broken handshake and closes without a word"""


def _context(purpose: ssl.Purpose, cafile: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(purpose, cafile=cafile)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def server_context(sec: SecurityConfig) -> ssl.SSLContext | None:
    """The context servers present ``tls_cert`` with (None: plain); :class:`ConfigError`
    when only one of ``tls_cert``/``tls_key`` is set or they cannot be loaded."""
    if not sec.tls_cert and not sec.tls_key:
        return None
    if not (sec.tls_cert and sec.tls_key):
        raise ConfigError("[security] tls_cert/tls_key", "set both, or neither")
    ctx = _context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(sec.tls_cert, sec.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError("[security] tls_cert/tls_key", f"cannot load them: {e}") from None
    warn_if_shared(sec.tls_key, "[security] tls_key")
    return ctx


def client_context(sec: SecurityConfig) -> ssl.SSLContext | None:
    """The context clients verify servers with, by ``tls_ca`` (None: plain);
    :class:`ConfigError` when the CA file cannot be loaded."""
    if not sec.tls_ca:
        return None
    try:
        return _context(ssl.Purpose.SERVER_AUTH, sec.tls_ca)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError("[security] tls_ca", f"cannot load {sec.tls_ca}: {e}") from None


def http_scheme(tls: ssl.SSLContext | None) -> str:
    """The scheme of our HTTP endpoints for a client, or a server, with context ``tls``."""
    return "http" if tls is None else "https"


def describe(sec: SecurityConfig) -> str:
    """One line for a process's start log: TLS on or off, and where the tokens come from."""
    tls = []
    if sec.tls_cert:
        tls.append(f"serving with {sec.tls_cert}")
    if sec.tls_ca:
        tls.append(f"verifying servers by {sec.tls_ca}")
    parts = [f"TLS on ({', '.join(tls)})" if tls else "TLS off"]
    if sec.token_file:
        parts.append(f"token from {sec.token_file}")
    elif sec.token:
        parts.append("token set")
    if sec.tenant_tokens_file:
        parts.append(f"tenant tokens from {sec.tenant_tokens_file}")
    elif sec.tenant_tokens:
        parts.append(f"{len(sec.tenant_tokens)} tenant tokens")
    if len(parts) == 1:
        parts.append("no token (connections are not authenticated)")
    return "security: " + ", ".join(parts)
