"""The scheduler side's cluster client: made on first use, closed once.

Errors talking to the cluster are logged at most once per 10 s (serving goes on), so a
dead cluster does not flood the engine's log.  Pure module: no vLLM import.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

logger = logging.getLogger("pegaflow.connector")

ERROR_LOG_EVERY_S = 10.0
"""least time between two warnings of failed cluster calls"""


class LookupClient(Protocol):
    """The part of :class:`pegaflow.client.SyncPegaClient` the scheduler uses."""

    def lookup_here(
        self,
        ns: str,
        hashes: Sequence[bytes],
        shards: Sequence[int] = (0,),
        timeout: float | None = None,
        generations: bool = False,
        warm_up: bool = False,
    ) -> Any: ...


class ClusterClient:
    """Holds the lookup client: ``client``, else one made by ``factory`` on first use.

    Args:
        client: the client (``None``: made by ``factory`` on first use).
        factory: builds the client.
        clock: monotonic clock (rate-limits the error log).
    """

    def __init__(
        self,
        client: LookupClient | None,
        factory: Callable[[], LookupClient] | None,
        clock: Callable[[], float],
    ) -> None:
        self.factory = factory
        self._client = client
        self._clock = clock
        self._lock = threading.Lock()
        self._closed = False
        self._last_error_log = -1e9

    def get(self) -> LookupClient | None:
        """The client (made now if need be); None once closed or when it cannot be made."""
        with self._lock:
            if self._closed:
                return None
            if self._client is None and self.factory is not None:
                try:
                    self._client = self.factory()
                except Exception as e:
                    self.log_error("cannot create the cluster client", e)
                    return None
            return self._client

    def log_error(self, what: str, e: BaseException) -> None:
        """Warn that a cluster call failed (at most once per :data:`ERROR_LOG_EVERY_S`)."""
        now = self._clock()
        if now - self._last_error_log >= ERROR_LOG_EVERY_S:
            self._last_error_log = now
            logger.warning("PegaFlow: %s: %s: %s (serving goes on)", what, type(e).__name__, e)

    def close(self) -> None:
        """Close the client; :meth:`get` returns None from now on."""
        with self._lock:
            self._closed = True
            c, self._client = self._client, None
        close = getattr(c, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass
