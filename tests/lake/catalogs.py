"""What the catalog tests share (their fixtures are in conftest.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from quiverd.kernel.config import CatalogConfig
from quiverd.lake.catalog import Catalog

Target = tuple[CatalogConfig, Path]
Opener = Callable[[], Awaitable[Catalog]]


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    warning = error = info
