"""What every service's ``main()`` shares: flags from the config schema, logging, uvloop."""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from pegaflow.addresses import settle
from pegaflow.config import ArgParser, ClusterConfig, add_arguments, config_from_args

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


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
    run: Callable[[ClusterConfig], Coroutine[Any, Any, None]],
    argv: list[str] | None = None,
    defaults: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Parse ``--<section>-<option>`` flags (and ``--config``), set up logging, and run
    ``run(cfg)`` on uvloop until it returns.

    A bad command line or configuration (an unknown flag, a bad value, a config file
    that is missing or malformed) is one line on stderr and exit status 2, as is a start
    that fails with ``OSError`` or ``ValueError`` (``--log-level DEBUG`` adds the
    traceback).  ``defaults``: the program's own defaults (see
    :func:`pegaflow.config.load_config`)."""
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
    try:
        uvloop.run(run(cfg))
    except (OSError, ValueError) as e:
        logging.getLogger(prog).debug("%s failed", prog, exc_info=True)
        hint = "" if args.log_level == "DEBUG" else " (--log-level DEBUG shows where)"
        parser.exit(2, f"{prog}: error: {e}{hint}\n")


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
