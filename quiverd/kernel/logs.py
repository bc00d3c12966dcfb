"""structlog, configured once: JSON lines under systemd, console on a TTY."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO,
           "warning": logging.WARNING, "error": logging.ERROR}


def configure(fmt: str = "auto", level: str = "info") -> None:
    """Set up structlog for the process; ``fmt`` is auto | json | console."""
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: Any = (structlog.dev.ConsoleRenderer(colors=False) if use_console
                     else structlog.processors.JSONRenderer())
    if os.environ.get("JOURNAL_STREAM"):
        # stderr goes to journald: a "<N>" prefix sets the line's priority, so
        # `journalctl -p err` finds errors (SyslogLevelPrefix=yes is the default).
        renderer = _JournalPriority(renderer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


Logger = structlog.typing.FilteringBoundLogger


def get(name: str, **bound: Any) -> Logger:
    """A logger bound to a component name (and e.g. ``shard=0``)."""
    logger: Logger = structlog.get_logger(name).bind(component=name, **bound)
    return logger


_PRIORITY = {"critical": 2, "error": 3, "warning": 4, "info": 6, "debug": 7}


class _JournalPriority:
    """Wraps a renderer: ``<3>{...}`` for an error line, ``<6>{...}`` for info."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, logger: Any, method: str, event: dict[str, Any]) -> str:
        level = str(event.get("level", method))
        return f"<{_PRIORITY.get(level, 6)}>{self.inner(logger, method, event)}"


def quiet(component: str) -> Logger:
    """Warnings and errors as JSON lines on stderr, whatever ``configure`` set: for code
    running inside another program (a Spark worker's stdout is not ours to print on)."""
    logger: Logger = structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()])
    return logger.bind(component=component)
