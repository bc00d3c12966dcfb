"""The lake's health: which of its parts is degraded, since when, and why.

    part      what failed                               kinds
    store     lake.store (OpenDAL)                      missing, denied, unavailable, config
    catalog   catalog.sqlite / catalog.dsn              unavailable
    staging   <data_dir>/staging (local Parquet files)  no_space, io
    iceberg   the Iceberg projection's catalog or store  unavailable
    lake      anything else the lake raised             internal

The lake is a subscriber like any other: a fault in one of its parts never stops the
daemon, ingest or other subscribers. The part that failed is marked degraded (one log
line ``lake_degraded`` when it starts, ``lake_restored`` when it ends), the work is
retried with backoff, and the bundles wait in segments under the retention rules.
``status`` shows each degraded part (kind, last error, since when, attempts),
``/metrics`` the gauge ``quiver_lake_degraded{part,kind}``, ``/healthz`` answers 503.
Event-loop only (no locks): every caller runs on the daemon's loop.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from quiverd.kernel.errors import QuiverError
from quiverd.kernel.logs import Logger

PARTS = ("store", "catalog", "staging", "iceberg", "lake")
MAX_ERROR_CHARS = 500  # an error text is bounded (S3 answers can be long)


@dataclass
class Fault:
    kind: str
    error: str
    hint: str
    since_ns: int  # wall clock, when the part became degraded
    last_ns: int  # wall clock, the latest failure
    attempts: int


class LakeHealth:
    def __init__(self, *, log: Logger) -> None:
        self.log = log
        self.faults: dict[str, Fault] = {}

    def fail(self, part: str, kind: str, exc: BaseException, *, hint: str = "") -> None:
        """Record a failure of ``part``; the first one of a run logs ``lake_degraded``."""
        now = time.time_ns()
        text = f"{exc}" if isinstance(exc, QuiverError) else f"{type(exc).__name__}: {exc}"
        text = text[:MAX_ERROR_CHARS]
        hint = hint or getattr(exc, "hint", "") or ""
        fault = self.faults.get(part)
        if fault is None or fault.kind != kind:
            since = now if fault is None else fault.since_ns
            self.faults[part] = Fault(kind=kind, error=text, hint=hint, since_ns=since,
                                      last_ns=now, attempts=1)
            self.log.error("lake_degraded", part=part, kind=kind, error=text, hint=hint)
            return
        fault.error, fault.hint, fault.last_ns = text, hint, now
        fault.attempts += 1

    def ok(self, part: str) -> None:
        """``part`` worked again: log ``lake_restored`` if it was degraded."""
        fault = self.faults.pop(part, None)
        if fault is not None:
            self.log.info("lake_restored", part=part, kind=fault.kind,
                          degraded_s=round((time.time_ns() - fault.since_ns) / 1e9, 1),
                          attempts=fault.attempts)

    @property
    def degraded(self) -> bool:
        return bool(self.faults)

    def status(self) -> dict[str, dict[str, object]]:
        return {part: asdict(fault) for part, fault in self.faults.items()}

    def gauge(self) -> dict[tuple[str, ...], float]:
        """``quiver_lake_degraded{part,kind}``: 1 per degraded part, 0 (kind "") otherwise."""
        out: dict[tuple[str, ...], float] = {}
        for part in PARTS:
            fault = self.faults.get(part)
            out[(part, fault.kind if fault else "")] = 1.0 if fault else 0.0
        return out
