"""The same-host control socket: ``locate``, ``unpin`` and local saves over a Unix socket.

A same-host reader (a GPU connector beside its node) asks the node where a prefix's
blocks lie in the pool file before every load, on the critical path of a request's
first token.  Over UCX on loopback that question costs a round trip of UCX active
messages; the control protocol (:mod:`pegaflow.rpc`) on a Unix socket answers it faster
(a 625-block locate in 0.79-0.83 ms instead of 0.95-1.19 ms on the CPU machine;
docs/benchmarks.md, "Same-host control").  The socket lies beside
the pool file, only the node's user may open it (as with the pool file itself), and it
admits the cluster token only: a tenant may never see where blocks lie.

A same-host save asks it too: ``reserve`` (local only) before the writer copies into
the slots and ``commit`` after; a reservation made on one session (connection) of the
socket is committed or aborted on that session only, and is dropped when it closes.
Each session is an owner of its own for the node's quotas and read pins.

The node advertises the socket in its UCX ``hello`` reply (``pool.control``), next to
the pool file; the ops and their answers are those of the node's protocol
(:mod:`pegaflow.storage_node.protocol`, whose table says which ops the socket serves),
as the ``args`` and ``result`` of control requests.  Clients that cannot open the
socket keep asking over UCX.

The node serves the socket on a thread and event loop of its own
(:class:`~pegaflow.loopthread.LoopThread`): ``locate`` and ``unpin`` are answered there,
however busy the data loop is with bulk transfers; the ops on reservations (``reserve``,
``commit``, ``abort``, ``taken``) and ``report`` go on to the data loop in arrival order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pegaflow.auth import Authenticator
from pegaflow.rpc import RpcServer, current_session

log = logging.getLogger(__name__)

SOCKET_SUFFIX = ".sock"
MAX_PATH = 107
"""longest Unix socket path Linux accepts (sun_path holds 108 bytes with the NUL)"""


class LocalControl:
    """Serves ``handlers`` (op -> function of the request's args, plain or async) on a
    Unix socket at ``path``; ``on_request(op, seconds, error code)`` sees every request
    and ``on_session_end(session)`` each session (see :meth:`session`) that closes."""

    def __init__(
        self,
        path: str,
        handlers: dict[str, Callable[[dict[str, Any]], Any]],
        auth: Authenticator,
        max_frame: int,
        on_request: Callable[[str, float, str | None], None] | None = None,
        on_session_end: Callable[[object], None] | None = None,
    ) -> None:
        self.path = path
        self._server = RpcServer(
            "pegaflow-node-local",
            dict(handlers),
            auth=auth,
            max_frame=max_frame,
            on_request=on_request,
            on_disconnect=on_session_end,
        )

    @staticmethod
    def session() -> object | None:
        """Inside a handler: the session (one client connection) whose request it
        serves, a key for what that session holds."""
        return current_session()

    async def start(self) -> bool:
        """Listen; False (logged) when the socket cannot be made, clients then use UCX."""
        if len(self.path.encode()) > MAX_PATH:
            log.warning(
                "same-host control socket not served: path %s is longer than %d bytes "
                "(a shorter [node] shm_dir fixes it); same-host clients use UCX",
                self.path, MAX_PATH,
            )  # fmt: skip
            return False
        try:
            await self._server.start_unix(self.path)
        except OSError as e:
            log.warning(
                "same-host control socket %s not served (%s); same-host clients use UCX",
                self.path, e,
            )  # fmt: skip
            return False
        log.info("same-host control socket at %s", self.path)
        return True

    async def close(self) -> None:
        """Stop listening, drop the connections and remove the socket."""
        await self._server.close()
