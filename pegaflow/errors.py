"""Typed errors shared by every component and carried on the wire.

Every error that crosses a process boundary is a :class:`PegaError` subclass with a
stable ``code``.  Replies carry ``{"code": ..., "message": ...}``; the receiving side
rebuilds the same class with :func:`error_from_wire`, so callers can ``except`` on
the type whatever process raised it.
"""

from __future__ import annotations

from typing import Any

ERRORS_BY_CODE: dict[str, type[PegaError]] = {}
"""each error carried on the wire, by its code"""


class PegaError(Exception):
    """Base class of all PegaFlow errors; ``code`` is its stable wire name.  A subclass
    declared with ``code=...`` (``class NoSpace(PegaError, code="no_space")``) is carried
    on the wire: :func:`error_from_wire` rebuilds it."""

    code = "internal"

    def __init_subclass__(cls, code: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
            ERRORS_BY_CODE[code] = cls

    def to_wire(self) -> dict[str, Any]:
        """The error as a msgpack-ready map."""
        return {"code": self.code, "message": str(self)}


class BadRequest(PegaError, code="bad_request"):
    """The request is malformed: a missing or mistyped field, an unknown op."""


class TooLarge(PegaError, code="too_large"):
    """A frame, field or batch exceeds a configured limit."""


class ProtocolError(PegaError, code="protocol"):
    """The peer does not speak our protocol (bad framing, version, handshake)."""


class Unauthorized(PegaError, code="unauthorized"):
    """The shared-secret token is missing or wrong."""


class DeadlineExceeded(PegaError, code="deadline"):
    """The call did not finish within its deadline."""


class Unavailable(PegaError, code="unavailable"):
    """No peer could be reached (connection refused, reset, all endpoints down)."""


class HandshakeRefused(Unavailable, code="handshake_refused"):
    """The peer refused our connection at its handshake and said why (a UCX address it
    cannot take: another UCX release or configuration, or an address that names the
    peer's own host but came from elsewhere).  An ``Unavailable``: the peer cannot be
    used, whatever is retried."""


class WrongPeer(Unavailable, code="wrong_peer"):
    """The process answering at an address is not the one the caller meant (another
    node answers at the address a node published: an address that is not its own, such
    as a loopback or wildcard ``[node] host`` in a cluster of several hosts).  The data
    client raises it when the node id in a node's UCX hello is not the id of the node
    record whose address it dialled (:mod:`pegaflow.client.data`): nothing is sent to
    the node that answered."""


class PoolChanged(PegaError, code="pool_changed"):
    """A same-host request named a pool file that is not the node's now: the node was
    restarted on a new file at the same path (a cleaned ``/dev/shm``, a new emptyDir)
    while the caller still maps the old one.  Nothing written through the old mapping is
    taken; the caller maps the node's file again (:mod:`pegaflow.connector.media.localpath`)."""


class NoSpace(PegaError, code="no_space"):
    """The storage pool cannot hold the block even after eviction."""


class QuotaExceeded(PegaError, code="quota"):
    """The request would take this connection or tenant past its share of a node (bytes
    reserved, bytes pinned); it may succeed once the client's own holds are released."""


class NotFound(PegaError, code="not_found"):
    """The named object (block, reservation, node) does not exist."""


class IncompatibleFormat(PegaError, code="incompatible_format"):
    """Stored data (e.g. a disk tier's files) was written by an incompatible version or
    for another geometry: it is refused, never misread."""


class Internal(PegaError, code="internal"):
    """An unexpected failure inside the serving process (a bug: please report)."""


class UcxNotInstalled(ImportError):
    """``ucxx`` cannot be imported: the data plane (``pegaflow-node``, ``pegaflow-server``,
    the connector's client) needs the extra of the host's CUDA, ``cu12`` or ``cu13``.
    Raised at import, never carried on the wire."""

    def __init__(self, cause: ImportError) -> None:
        super().__init__(
            f"cannot import ucxx ({cause}): the storage node, pegaflow-server and the "
            "connector move blocks over UCX; install pegaflow-cluster with the extra of "
            "this host's CUDA, 'pegaflow-cluster[cu12]' (CUDA 12) or "
            "'pegaflow-cluster[cu13]' (CUDA 13), e.g. "
            "pip install '/opt/pegaflow-cluster[cu12]' from a checkout or wheel",
            name="ucxx",
        )


def error_from_wire(obj: Any) -> PegaError:
    """Rebuild a typed error from its wire map; anything unexpected is :class:`Internal`."""
    if isinstance(obj, dict):
        cls = ERRORS_BY_CODE.get(str(obj.get("code")), Internal)
        return cls(str(obj.get("message", "")))
    return Internal(f"malformed error reply: {obj!r:.200}")
