"""One process runner for every service's ``main()``.

:func:`run_service` parses the flags of the config schema (``--config``,
``--log-level``, ``--<section>-<option>``), sets up logging and runs the service on
uvloop.  The service's ``start(cfg, runner)`` enters its components into the
:class:`Runner`'s one :class:`~contextlib.AsyncExitStack` (telemetry, the HTTP site,
the service's own parts) and returns its ``READY ...`` line; the runner prints it, serves
until SIGINT or SIGTERM, and takes everything down in the reverse order of its start.

Exit status: 0 after a stop by signal; 1 when stopped while starting; 2 for a bad
command line or configuration (an unknown flag, a bad value, a config file missing or
malformed) and for a start that fails (:meth:`Runner.fail`, or ``OSError`` /
``ValueError`` / :class:`~pegaflow.errors.UcxNotInstalled`: one line on stderr,
``--log-level DEBUG`` adds the traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import uvloop

from pegaflow.addresses import settle
from pegaflow.config import ArgParser, ClusterConfig, add_arguments, config_from_args
from pegaflow.errors import UcxNotInstalled
from pegaflow.observability import telemetry
from pegaflow.tls import describe, server_context

if TYPE_CHECKING:  # aiohttp's import takes most of a second: only a service with a site
    from prometheus_client import CollectorRegistry

    from pegaflow.observability.http import HealthFn, HttpHandle, StatusFn

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

#: A service's start: enters its components into the runner, returns its READY line.
Start = Callable[[ClusterConfig, "Runner"], Coroutine[Any, Any, str]]


def _log_level(value: str) -> str:
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"not a log level: {value!r} ({', '.join(LOG_LEVELS)})")
    return level


def build_parser(
    prog: str,
    description: str | None,
    sections: list[str],
    defaults: dict[str, dict[str, Any]] | None = None,
) -> ArgParser:
    """The command line of a service: ``--config``, ``--log-level`` and a
    ``--<section>-<option>`` flag for every option of its ``sections``."""
    parser = ArgParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{prog} [--config FILE] [--log-level LEVEL] [--<table>-<option> VALUE ...]",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=_log_level,
        metavar="LEVEL",
        help=f"{', '.join(LOG_LEVELS)} (default: INFO)",
    )
    add_arguments(parser, sections, defaults)
    return parser


def run_service(
    prog: str,
    description: str | None,
    sections: list[str],
    start: Start,
    argv: list[str] | None = None,
    defaults: dict[str, dict[str, Any]] | None = None,
    prepare: Callable[[ClusterConfig], None] | None = None,
) -> None:
    """Parse ``--<section>-<option>`` flags (and ``--config``), set up logging, and run
    the service ``start`` brings up on uvloop until SIGINT/SIGTERM (see the module
    docstring).  ``defaults``: the program's own defaults (see
    :func:`pegaflow.config.load_config`); ``prepare``: called with the configuration
    before the event loop starts (it may re-execute the process)."""
    parser = build_parser(prog, description, sections, defaults)
    args = parser.parse_args(argv)
    try:
        cfg = settle(config_from_args(args, defaults), sections)
    except ValueError as e:
        parser.exit(2, f"{prog}: error: {e}\n")
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if prepare is not None:
        prepare(cfg)
    try:
        uvloop.run(Runner(prog, cfg).serve(start))
    except (OSError, ValueError, UcxNotInstalled) as e:
        logging.getLogger(prog).debug("%s failed", prog, exc_info=True)
        hint = "" if args.log_level == "DEBUG" else " (--log-level DEBUG shows where)"
        parser.exit(2, f"{prog}: error: {e}{hint}\n")


class Runner:
    """One service process: its configuration, its exit stack and its stop.

    ``log``: the service's logger.  ``stopping``: the line logged when a stop begins
    (the service sets it once it knows what it runs)."""

    def __init__(self, prog: str, cfg: ClusterConfig) -> None:
        self.prog = prog
        self.cfg = cfg
        self.log = logging.getLogger(prog.replace("-", ".", 1))
        self.stopping = "stopping"
        self.stack = contextlib.AsyncExitStack()

    async def serve(self, start: Start) -> None:
        """Start (a signal meanwhile cancels it: exit status 1), print the READY line,
        wait for SIGINT/SIGTERM, then close the stack."""
        loop = asyncio.get_running_loop()
        starting = asyncio.current_task()
        assert starting is not None
        stop = asyncio.Event()
        async with self.stack:
            self._on_signal(loop, starting.cancel)
            self.log.info("%s", describe(self.cfg.security))
            try:
                ready = await start(self.cfg, self)
            except asyncio.CancelledError:
                self._on_signal(loop, lambda: None)  # a second signal leaves teardown be
                self.log.info("stopped while starting")
                raise SystemExit(1) from None
            self._on_signal(loop, stop.set)
            print(ready, flush=True)
            await stop.wait()
            self.log.info(self.stopping)

    @staticmethod
    def _on_signal(loop: asyncio.AbstractEventLoop, handler: Callable[[], Any]) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, handler)

    async def enter(self, start: Awaitable[Any], close: Callable[[bool], Awaitable[Any]]) -> None:
        """Await ``start`` with ``close`` on the stack first, so that it runs at exit
        whether or not the start completed; ``close(failed)``: whether the process is
        ending by an error (a failed start) rather than by a stop."""

        async def exit_(
            et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
        ) -> bool:
            await close(et is not None)
            return False

        self.stack.push_async_exit(exit_)
        await start

    def telemetry(self, registry: CollectorRegistry | None) -> None:
        """Start OTLP export (``[telemetry]``) of ``registry``; shut down last."""
        telemetry.setup(self.cfg.telemetry, service=self.prog, registry=registry)
        self.stack.callback(telemetry.shutdown)

    async def http(
        self,
        host: str,
        port: int,
        *,
        status: StatusFn,
        health: HealthFn,
        registry: CollectorRegistry | None,
    ) -> HttpHandle:
        """The HTTP site: ``/health``, ``/metrics``, ``/v1/status`` on ``host:port``."""
        from pegaflow.observability.http import start_http

        handle = await start_http(
            host, port, status=status, health=health, registry=registry,
            tls=server_context(self.cfg.security),
        )  # fmt: skip
        self.stack.push_async_callback(handle.close)
        return handle

    def fail(self, msg: str, *args: Any) -> NoReturn:
        """Log why the start failed (at ERROR) and exit with status 2."""
        self.log.error(msg, *args)
        raise SystemExit(2)

    def fail_on_ports(
        self, what: str, e: BaseException, ports: list[tuple[str, int, str]]
    ) -> NoReturn:
        """:meth:`fail` for ``e``, naming the flags of those of ``ports`` in use now."""
        hint = taken_ports(ports)
        self.fail("%s: %s%s", what, e, f" ({hint})" if hint else "")


def taken_ports(ports: list[tuple[str, int, str]]) -> str:
    """After a failed start: which of ``(host, port, flag)`` are in use now, as a hint
    naming their flags (empty when none is, or all are 0 / -1: any port / off)."""
    busy = []
    for host, port, flag in ports:
        if port <= 0:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    busy.append(f"{host}:{port} is in use ({flag} picks another)")
    return "; ".join(busy)
