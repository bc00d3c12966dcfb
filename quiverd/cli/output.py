"""How the command line prints: UTC times and aligned tables."""

from __future__ import annotations

import datetime
from typing import Any


def utc(ts_ns: int) -> str:
    """Nanoseconds since the epoch as an ISO-8601 UTC time, to the millisecond."""
    when = datetime.datetime.fromtimestamp(ts_ns / 1e9, tz=datetime.UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def table(cols: list[str], rows: list[dict[str, Any]], *, left: bool = False) -> None:
    """Print ``rows`` under ``cols``, right-aligned (numbers) or left-aligned (names)."""
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c)
              for c in cols]

    def line(values: list[str]) -> str:
        return "  ".join((v.ljust(w) if left else v.rjust(w))
                         for v, w in zip(values, widths, strict=True)).rstrip()

    print(line(cols))
    for r in rows:
        print(line([str(r.get(c, "")) for c in cols]))
