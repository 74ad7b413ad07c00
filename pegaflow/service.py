"""What every service's ``main()`` shares: flags from the config schema, logging, uvloop."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from pegaflow.config import ClusterConfig, add_arguments, config_from_args


def run_service(
    prog: str,
    description: str | None,
    sections: list[str],
    run: Callable[[ClusterConfig], Coroutine[Any, Any, None]],
    argv: list[str] | None = None,
    defaults: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Parse ``--<section>-<option>`` flags (and ``--config``), set up logging, and run
    ``run(cfg)`` on uvloop until it returns.  A bad configuration exits with a message.
    ``defaults``: the program's own defaults (see :func:`pegaflow.config.load_config`)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    add_arguments(parser, sections)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = config_from_args(args, defaults)
    except (OSError, ValueError) as e:
        parser.error(f"bad configuration: {e}")
    uvloop.run(run(cfg))
