"""structlog, configured once: JSON lines under systemd, console on a TTY."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO,
           "warning": logging.WARNING, "error": logging.ERROR}


def configure(fmt: str = "auto", level: str = "info", *, file: TextIO | None = None) -> None:
    """Set up structlog for the process; ``fmt`` is auto | json | console; lines go to
    ``file``, stderr by default."""
    out = sys.stderr if file is None else file
    use_console = fmt == "console" or (fmt == "auto" and out.isatty())
    renderer: Any = (structlog.dev.ConsoleRenderer(colors=False) if use_console
                     else structlog.processors.JSONRenderer())
    if file is None and os.environ.get("JOURNAL_STREAM"):
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
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )


@contextlib.contextmanager
def configured(fmt: str, level: str, *, file: TextIO) -> Iterator[None]:
    """``configure`` while the block runs, then the configuration from before it: for a
    daemon inside another program (the tests' in-process daemons). structlog's
    configuration is the process's, so one such block at a time."""
    saved = structlog.get_config()
    configure(fmt, level, file=file)
    try:
        yield
    finally:
        structlog.configure(**saved)


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
