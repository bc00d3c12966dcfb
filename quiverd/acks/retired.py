"""Retired subscribers: who was retired for having no consumer, and why (``retired.json``).

Layout of ``<data_dir>/retired.json`` (SPEC §5), written with ``atomic_write``::

    {"version": 1,
     "retired": [{"name": "exp-1", "reason": "lag_bytes", "lag_bytes": 3145728,
                  "idle_s": 61.2, "retired_at_ns": 1764763200000000000}, ...]}

The retirement itself is a subscriber remove in every shard's ack.log (so the segments
it held can go); this file only keeps the reason, so a consumer that comes back is told
why its subscriber is gone instead of "no subscriber named ...". The mark is written
before the removes, and a mark is in force only while no shard has the name
registered: a crash between the mark and the removes leaves a registered subscriber
(the daemon decides again), and a re-add (``quiverd subscribers add``) voids the mark
at once and drops it from the file after. One file for the daemon, not one per shard:
the decision covers every shard at once.

Bounded: at most ``MAX_MARKS`` marks, the oldest dropped first. A file that cannot be
read is reported by the caller and replaced at the next write: it holds reasons, not
data (the removes are in ack.log either way).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from quiverd.kernel.durable import atomic_write

VERSION = 1
MAX_MARKS = 1024  # a retirement per abandoned experiment; far above a real count
REASONS = ("lag_bytes", "idle")


class RetiredMark(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    reason: str  # one of REASONS
    lag_bytes: int  # the subscriber's lag over every shard when it was retired
    idle_s: float  # seconds it had been without a consumer
    retired_at_ns: int  # wall clock

    def text(self) -> str:
        """What a consumer coming back is told (with the way back)."""
        why = (f"its lag reached {self.lag_bytes} bytes" if self.reason == "lag_bytes"
               else f"it had no consumer for {self.idle_s:.0f} s while lagging "
               f"({self.lag_bytes} bytes)")
        return (f"subscriber {self.name!r} was retired at {_utc(self.retired_at_ns)}: {why} "
                f"with no consumer connected (retention.retire_*); its unread bundles were "
                f"released. Re-add it with `quiverd subscribers add {self.name}` (it starts "
                "again from the retained segments)")


class RetiredFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    version: int
    retired: list[RetiredMark]


class RetiredMarks:
    """The marks by name; ``save`` writes them (blocking: call it from a worker thread)."""

    def __init__(self, path: Path, marks: list[RetiredMark] | None = None) -> None:
        self.path = path
        self._marks: dict[str, RetiredMark] = {m.name: m for m in marks or []}

    def __iter__(self) -> Iterator[RetiredMark]:
        """Oldest retirement first."""
        return iter(sorted(self._marks.values(), key=lambda m: m.retired_at_ns))

    def __len__(self) -> int:
        return len(self._marks)

    def get(self, name: str) -> RetiredMark | None:
        return self._marks.get(name)

    def add(self, mark: RetiredMark) -> None:
        self._marks.pop(mark.name, None)
        self._marks[mark.name] = mark
        while len(self._marks) > MAX_MARKS:
            oldest = min(self._marks.values(), key=lambda m: m.retired_at_ns)
            del self._marks[oldest.name]

    def discard(self, name: str) -> bool:
        return self._marks.pop(name, None) is not None

    def encode(self) -> bytes:
        return encode(list(self))

    def save(self) -> None:
        atomic_write(self.path, self.encode())


def encode(marks: list[RetiredMark]) -> bytes:
    return msgspec.json.encode(RetiredFile(version=VERSION, retired=marks)) + b"\n"


def decode(data: bytes) -> list[RetiredMark]:
    """The marks of a ``retired.json``; ValueError for anything else."""
    try:
        f = msgspec.json.decode(data, type=RetiredFile)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a retired.json: {exc}") from None
    if f.version != VERSION:
        raise ValueError(f"retired.json version {f.version}, this build reads {VERSION}")
    return f.retired


def load(path: Path) -> RetiredMarks:
    """The marks in ``path`` (none if absent); ValueError if it cannot be read as one."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return RetiredMarks(path)
    return RetiredMarks(path, decode(data))


def _utc(ns: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns / 1e9))
