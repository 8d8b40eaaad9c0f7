"""structlog configuration shared by the daemon, the agents and the CLIs.

JSON lines when the output is not a terminal (journald, files), readable console output on a TTY.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog


def configure_logging(fmt: Literal["auto", "json", "console"] = "auto", level: str = "info",
                      stream=None) -> None:
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer = (structlog.dev.ConsoleRenderer(colors=stream.isatty()) if fmt == "console"
                else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def get_logger(role: str, **bound):
    """A logger prefixed by role (daemon, agent, worker) and any identifiers (job, node, rank)."""
    return structlog.get_logger().bind(role=role, **bound)
