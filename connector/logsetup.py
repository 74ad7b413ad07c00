"""Where the connector's log lines go: the engine's log (:func:`setup_logging`)."""

from __future__ import annotations

import logging

logger = logging.getLogger("pegaflow.connector")


def setup_logging(level: str) -> None:
    """Make the ``pegaflow`` loggers of this process print in the engine's log.

    vLLM gives only its own ``vllm`` logger a handler; without one, the connector's INFO
    lines (the same-host node found, the ``PegaFlow cache:`` report) would go nowhere, or
    to a root handler at WARNING (vLLM 0.26 on the H200 has one).  Unless ``pegaflow``
    has handlers of its own, they go to vLLM's handlers at vLLM's level (and not on to
    the root); with the ``log_level`` setting, to a handler of their own at that level
    (and not on to the root either).
    """
    log = logging.getLogger("pegaflow")
    if level:
        try:
            log.setLevel(level.upper())
        except ValueError:
            logger.warning("PegaFlow: unknown log_level %r ignored", level)
            level = ""
    if log.handlers:
        return  # configured by the process (or by an earlier connector)
    vllm_log = logging.getLogger("vllm")
    if not level and vllm_log.handlers:
        if log.level == logging.NOTSET:
            log.setLevel(vllm_log.getEffectiveLevel())
        for h in vllm_log.handlers:
            log.addHandler(h)
        log.propagate = False
        return
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.propagate = False  # a root handler would print each line again
