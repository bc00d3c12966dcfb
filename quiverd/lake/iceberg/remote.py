"""The daemon's projection in a worker process: Iceberg's commits off the daemon's GIL.

    Projector (event loop) ──RemoteProjection.commit(...)──▶ anyio.to_process (one worker)
                                                              └─ Projection (this module's
                                                                 global, opened on first use)

A commit is pure-Python work (Avro manifests, metadata JSON, SQLAlchemy): run in a
thread of the daemon it holds the GIL in 5 ms slices, and the event loop, which gives
the GIL up at every socket and queue operation, waits a slice each time (measured: the
uploader at 0.70-0.77 of its throughput with 8 MiB files, bench/iceberg.py). In a
worker process it costs only CPU. One call per batch (a commit, a reconcile read), one
worker at a time (the limiter); the worker keeps its catalog connection and loaded
tables between calls, and anyio ends it after 5 minutes idle (the next call opens a new
one). Errors come back as (kind, message) and are raised again here as quiverd's own:
exceptions are not pickled across.

The worker ends with the daemon: at its first call it asks Linux for SIGKILL when its
parent dies (``prctl(PR_SET_PDEATHSIG)``), and before every call it checks that its
parent is still the daemon that started it. Without that, a worker busy in a commit
(waiting on a locked catalog, retrying a compare-and-swap) outlived a killed daemon by
10-40 s and committed next to the restarted daemon's own worker.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import anyio
import anyio.to_process
import msgspec

from quiverd.kernel.config import IcebergConfig
from quiverd.kernel.errors import (
    CatalogUnavailable,
    IcebergCommitFailed,
    LakeError,
    StoreUnavailable,
)
from quiverd.lake.iceberg.files import DataFileRef
from quiverd.lake.iceberg.projection import CommitResult, Projection

_ERRORS: dict[str, type[LakeError]] = {"catalog": CatalogUnavailable, "store": StoreUnavailable,
                                       "commit": IcebergCommitFailed}


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """What opens a ``Projection`` (sent with every call; compared, not hashed)."""

    catalog_uri: str
    warehouse: str
    io_properties: dict[str, str]
    cfg: IcebergConfig
    parent_pid: int = 0  # the daemon's pid: the worker ends when it does (0: no check)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_opened: tuple[Settings, Projection] | None = None
_armed = 0  # the parent pid PR_SET_PDEATHSIG was set for (worker side)


def die_with_parent(parent_pid: int) -> None:
    """In the worker: end at once if the daemon is gone, and have Linux kill this
    process when it goes (armed once). The check after arming closes the race of a
    daemon that died before the signal was asked for."""
    global _armed
    if parent_pid <= 0:
        return
    if _armed != parent_pid and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            _armed = parent_pid
    if os.getppid() != parent_pid:
        os._exit(1)  # orphaned: nothing may be committed for a daemon that is gone


def call(settings: Settings, method: str, args: tuple[Any, ...],
         kwargs: dict[str, Any]) -> tuple[str, Any]:
    """In the worker: ``Projection.<method>(*args, **kwargs)`` as ("ok", result) or
    (kind, message) with kind catalog | store | commit | error."""
    global _opened
    die_with_parent(settings.parent_pid)
    try:
        if _opened is None or _opened[0] != settings:
            if _opened is not None:
                _opened[1].close()
                _opened = None
            _opened = (settings, Projection(catalog_uri=settings.catalog_uri,
                                            warehouse=settings.warehouse,
                                            io_properties=settings.io_properties,
                                            cfg=settings.cfg))
        return "ok", getattr(_opened[1], method)(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - every error is told to the daemon
        return failure(exc)


def failure(exc: Exception) -> tuple[str, str]:
    """A worker call's error as (kind, message): exceptions are not pickled back."""
    if isinstance(exc, CatalogUnavailable):
        return "catalog", str(exc)
    if isinstance(exc, StoreUnavailable):
        return "store", str(exc)
    if isinstance(exc, IcebergCommitFailed):
        return "commit", str(exc)
    return "error", f"{type(exc).__name__}: {exc}"  # a library's error


class RemoteProjection:
    """``Projection``'s methods, awaited; each one call into the worker process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limiter = anyio.CapacityLimiter(1)

    async def commit(self, table: str, add: Sequence[DataFileRef], remove: Sequence[str] = (),
                     *, summary: Mapping[str, str] | None = None) -> CommitResult:
        result: CommitResult = await self._call("commit", table, list(add), list(remove),
                                                summary=dict(summary or {}))
        return result

    async def sync(self, table: str, want: Sequence[DataFileRef], gone: Collection[str], *,
                   source: str, base: int, summary: Mapping[str, str] | None = None,
                   known_skipped: Mapping[str, int] | None = None) -> CommitResult:
        result: CommitResult = await self._call("sync", table, list(want), sorted(gone),
                                                source=source, base=base,
                                                summary=dict(summary or {}),
                                                known_skipped=dict(known_skipped or {}))
        return result

    async def source_commits(self, table: str, source: str) -> int:
        n: int = await self._call("source_commits", table, source)
        return n

    async def live_locations(self, table: str) -> dict[str, str]:
        found: dict[str, str] = await self._call("live_locations", table)
        return found

    async def referenced_locations(self, table: str) -> set[str]:
        found: set[str] = await self._call("referenced_locations", table)
        return found

    async def expire(self, table: str, *, older_than_s: float) -> int:
        n: int = await self._call("expire", table, older_than_s=older_than_s)
        return n

    async def tables(self) -> list[str]:
        names: list[str] = await self._call("tables")
        return names

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        kind, value = await anyio.to_process.run_sync(call, self.settings, method, args, kwargs,
                                                      cancellable=True, limiter=self.limiter)
        if kind == "ok":
            return value
        raise _ERRORS.get(kind, LakeError)(f"Iceberg projection ({method}): {value}")
