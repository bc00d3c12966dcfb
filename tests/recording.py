"""A logger that records its events, for tests that assert on what was logged."""

from __future__ import annotations

from typing import Any


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    warning = error = info
