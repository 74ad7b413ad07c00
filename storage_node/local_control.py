"""The same-host control socket: ``locate``, ``unpin`` and local saves over a Unix socket.

A same-host reader (a GPU connector beside its node) asks the node where a prefix's
blocks lie in the pool file before every load, on the critical path of a request's
first token.  Over UCX on loopback that question costs a round trip of UCX active
messages; the control protocol (:mod:`pegaflow.protocol.framing`) on a Unix socket answers it faster
(a 625-block locate in 0.79-0.83 ms instead of 0.95-1.19 ms on the CPU machine;
docs/benchmarks.md, "Same-host control").  The socket lies beside
the pool file, only the node's user may open it (as with the pool file itself), and it
admits the cluster token only: a tenant may never see where blocks lie.

A same-host save asks it too: ``reserve`` (local only) before the writer copies into
the slots and ``commit`` after; a reservation made on one session (connection) of the
socket is committed or aborted on that session only, and is dropped when it closes.
Each session is a :class:`~pegaflow.storage_node.sessions.Session` of the node
service, an owner of its own for the node's quotas and read pins.

The node advertises the socket in its UCX ``hello`` reply (``pool.control``), next to
the pool file; the ops and their answers are those of the node's protocol
(:mod:`pegaflow.protocol.node`, whose table says which ops the socket serves),
as the ``args`` and ``result`` of control requests.  Clients that cannot open the
socket keep asking over UCX.

This site serves the socket on a thread and event loop of its own
(:class:`~pegaflow.transport.loopthread.LoopThread`): the ops the protocol table marks
:attr:`~.protocol.Loop.CONTROL` (``locate``, ``unpin``) are answered there, however busy
the data loop is with bulk transfers; the others (the ops on reservations and
``report``) go on to the data loop in arrival order, with the end of their session
behind them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
from collections.abc import Callable
from dataclasses import InitVar, dataclass
from typing import Any

from pegaflow.storage_node.metrics import NodeMetrics
from pegaflow.storage_node.node_service import NodeService
from pegaflow.storage_node.sessions import Session

from pegaflow.auth import Authenticator
from pegaflow.protocol.node import OPS, Loop, Op, Site
from pegaflow.transport.loopthread import LoopThread
from pegaflow.transport.rpc_server import RpcServer, current_session

log = logging.getLogger(__name__)

SOCKET_SUFFIX = ".sock"
MAX_PATH = 107
"""longest Unix socket path Linux accepts (sun_path holds 108 bytes with the NUL)"""


@dataclass(eq=False, repr=False)
class LocalControl:
    """Serves the ops of :data:`~.protocol.OPS` marked for :attr:`~.protocol.Site.SOCKET`
    on a Unix socket at ``path``, on a thread of its own, into ``service``; admits
    ``auth``'s cluster token only.  Start and close it on the data loop."""

    service: NodeService
    path: str
    auth: InitVar[Authenticator]
    max_frame: InitVar[int]
    metrics: NodeMetrics

    def __post_init__(self, auth: Authenticator, max_frame: int) -> None:
        service = self.service
        self._pins = service.pin_table()
        self._sessions: dict[object, Session] = {}
        """by rpc session (read on the socket's thread, ended on the data loop)"""
        self._thread: LoopThread | None = None
        handlers = {
            op.value: (self._here if spec.loop is Loop.CONTROL else self._on_data_loop)(op)
            for op, spec in OPS.items()
            if Site.SOCKET in spec.sites
        }
        loop = service.loop
        self._server = RpcServer(
            "pegaflow-node-local",
            handlers,
            auth=auth.cluster_only(),
            max_frame=max_frame,
            on_request=lambda *a: loop.call_soon_threadsafe(self._observe, *a),
            on_disconnect=lambda key: loop.call_soon_threadsafe(self._ended, key),
        )

    async def start(self) -> bool:
        """Listen on a thread of its own; False (logged) when the socket cannot be
        made: clients then use UCX."""
        if len(self.path.encode()) > MAX_PATH:
            log.warning(
                "same-host control socket not served: path %s is longer than %d bytes "
                "(a shorter [node] shm_dir fixes it); same-host clients use UCX",
                self.path, MAX_PATH,
            )  # fmt: skip
            return False
        thread = LoopThread("pegaflow-node-control")
        thread.start()
        try:
            await thread.run(self._server.start_unix(self.path))
        except OSError as e:
            thread.stop()
            log.warning(
                "same-host control socket %s not served (%s); same-host clients use UCX",
                self.path, e,
            )  # fmt: skip
            return False
        except BaseException:
            # cancelled (a SIGTERM/SIGINT while the node started: the first await after
            # the pool's preparation is this one): the socket may be bound on the thread
            # already; close() removes it
            self._thread = thread
            raise
        self._thread = thread
        log.info("same-host control socket at %s", self.path)
        return True

    async def close(self) -> None:
        """Stop listening, drop the connections, remove the socket and release the
        pins taken on it."""
        thread, self._thread = self._thread, None
        if thread is not None:
            await thread.run(self._close_here())
            thread.stop()

    async def _close_here(self) -> None:
        await self._server.close()
        self.service.release_pins(self._pins)

    def _session(self) -> Session:
        """The session whose request is being served (on the socket's thread)."""
        key = current_session()
        assert key is not None, "called outside a control-socket request"
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = Session(self._pins)
        return session

    def _here(self, op: Op) -> Callable[[dict[str, Any]], Any]:
        """A handler of ``op`` run on the socket's thread."""
        return lambda msg: self.service.call(op, msg, self._session())

    def _on_data_loop(self, op: Op) -> Callable[[dict[str, Any]], asyncio.Future[Any]]:
        """A handler (run on the socket's thread) that reads the request's session there
        and has ``op`` run on the data loop, in the order of the requests (its result
        awaited there when it is awaitable)."""
        loop = self.service.loop

        def handler(msg: dict[str, Any]) -> asyncio.Future[Any]:
            session = self._session()
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()

            def run() -> None:
                try:
                    result = self.service.call(op, msg, session)
                except BaseException as e:
                    done.set_exception(e)
                    return
                if not inspect.isawaitable(result):
                    done.set_result(result)
                    return
                asyncio.ensure_future(result).add_done_callback(lambda t: _settle(done, t))

            loop.call_soon_threadsafe(run)
            return asyncio.wrap_future(done)

        return handler

    def _ended(self, key: object) -> None:
        """A session closed (on the data loop, behind its requests)."""
        session = self._sessions.pop(key, None)
        if session is not None:
            self.service.end_session(session)

    def _observe(self, op: str, seconds: float, error: str | None) -> None:
        """Metrics of a request (on the data loop, as for UCX ones)."""
        self.metrics.request_done(op, seconds)
        if error is not None:
            self.metrics.request_failed(op, error)


def _settle(done: concurrent.futures.Future[Any], task: asyncio.Future[Any]) -> None:
    """Pass ``task``'s outcome to ``done`` (another thread waits on it)."""
    if task.cancelled():
        done.cancel()
    elif task.exception() is not None:
        done.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        done.set_result(task.result())
