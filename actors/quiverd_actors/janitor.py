"""Janitor: timers in, a reconciled lake out (orphans deleted, small files compacted,
damaged objects quarantined).

    every lake.janitor.interval_s     ──▶ lake.janitor.sweep     (objects <-> rows, staging)
    every lake.compaction.interval_s  ──▶ lake.compaction.compact (small files -> larger)
    every lake.scrub.pass_interval_s  ──▶ lake.scrub.scrub_pass  (objects vs size, CRC-32C)

All are periodic work with nothing to consume, so each runs on its own timer (0 turns
it off; ``quiverd janitor`` / ``quiverd compact`` / ``quiverd fsck --lake`` still run
them by hand). The first run comes ``min(interval, FIRST_RUN_MAX_S)`` after the start,
so a daemon restarted more often than the interval still gets swept. A failed run is
logged, counted in ``quiver_lake_errors_total{kind="janitor"|"compaction"|"scrub"}``,
and retried at the next tick; rows whose object is missing are counted under
``kind="missing_object"`` at every sweep that finds them, quarantined objects under
``kind="corrupt_object"`` and ``quiver_lake_objects_corrupt_total``. ``last_report``,
``last_compaction`` and ``last_scrub`` are kept for the CLI and tests; ``status`` shows
the scrub (``scrub_status``).

The scrub reads at ``lake.scrub.rate_mb_per_s``; a pass that takes longer than the
interval is followed at once by the next one. Its passes keep their pace across
restarts: ``<data_dir>/lake.scrub`` holds ``<start ns> <where>``, written when a pass
starts (``-``), every ``scrub.PROGRESS_EVERY_S`` during it (the last file id checked)
and when it ends (``done``; a file holding only ``<start ns>`` is from before and
counts as done). A finished pass is followed ``pass_interval_s`` after its recorded
start, also when a restart cut it and it was resumed; an unfinished one (cut by a
restart, or failed) resumes after its last file id ``min(pass_interval_s,
FIRST_RUN_MAX_S)`` later, so a restart neither reads the lake again from the beginning
nor leaves its rest unchecked for another interval. Every object is thus read at least once every
``max(pass_interval_s, bytes of the lake / rate)`` (plus ``FIRST_RUN_MAX_S`` per
restart): the bound docs/iceberg.md gives for a damaged object's exposure.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pyarrow as pa

from quiverd.kernel.durable import atomic_write
from quiverd.kernel.errors import LakeError
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import Metrics
from quiverd.lake.compaction import CompactionResult, compact
from quiverd.lake.janitor import Held, JanitorReport, sweep
from quiverd.lake.scrub import Corrupt, ScrubReport, scrub_pass
from quiverd.lake.tier import Tier

FIRST_RUN_MAX_S = 60.0
MIN_GAP_S = 1.0
NS_PER_S = 1_000_000_000
STARTED, DONE = "-", "done"  # lake.scrub's "where" besides a file id


class Janitor:
    def __init__(self, tier: Tier, *, log: Logger, metrics: Metrics, held: Held | None = None,
                 replaced: Callable[[], None] | None = None) -> None:
        self.tier, self.log, self.m = tier, log, metrics
        self.held = held  # ids of compacted rows a live Iceberg snapshot still references
        # Called when live files changed under the uploader: a compaction replaced some,
        # or the scrub quarantined one (the Iceberg projection reconciles then).
        self.replaced = replaced
        # Compaction's Parquet work runs in these threads (reads, zstd: GIL released).
        self.limiter = anyio.CapacityLimiter(max(1, tier.cfg.lake.compaction.parallelism))
        self.last_report: JanitorReport | None = None
        self.last_compaction: list[CompactionResult] = []
        self.last_scrub: ScrubReport | None = None
        self._resume: tuple[int, str] | None = None  # (start ns, last file id) to go on from

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run both timers until cancelled; returns at once when both are off."""
        lake = self.tier.cfg.lake
        async with anyio.create_task_group() as tg:
            if lake.janitor.interval_s > 0:
                tg.start_soon(self._every, lake.janitor.interval_s, self.sweep_once, "janitor")
            if lake.compaction.interval_s > 0:
                tg.start_soon(self._every, lake.compaction.interval_s, self.compact_once,
                              "compaction")
            if lake.scrub.rate_mb_per_s > 0:
                # Paced from each pass's recorded start, also across a restart that
                # resumed it (a pass cut short, or failed, resumes soon).
                tg.start_soon(self._every, lake.scrub.pass_interval_s, self._scrub_pass,
                              "scrub", self._scrub_due_in)
            task_status.started()

    async def sweep_once(self) -> JanitorReport:
        report = await sweep(self.tier, held=self.held)
        self.last_report = report
        if report.rows_missing_objects:
            self.m.lake_errors.labels("missing_object").inc(len(report.rows_missing_objects))
        if report.failures:
            self.m.lake_errors.labels("janitor").inc(len(report.failures))
        return report

    async def compact_once(self) -> list[CompactionResult]:
        results = await compact(self.tier, limiter=self.limiter, log=self.log)
        self.last_compaction = results
        if self.replaced is not None and any(r.outcome == "compacted" for r in results):
            self.replaced()
        failed = sum(1 for r in results if r.outcome == "failed")
        if failed:
            self.m.lake_errors.labels("compaction").inc(failed)
        return results

    async def scrub_once(self, *, after: str = "",
                         progress: Callable[[str], Awaitable[None]] | None = None
                         ) -> ScrubReport:
        async def corrupt(found: Corrupt) -> None:
            self.m.lake_objects_corrupt.labels().inc()
            self.m.lake_errors.labels("corrupt_object").inc()
            if self.replaced is not None:
                self.replaced()  # the projection reconciles now: the file leaves the table

        report = await scrub_pass(self.tier, on_corrupt=corrupt, after=after, progress=progress,
                                  rate_bytes_per_s=self.tier.cfg.lake.scrub.rate_mb_per_s * 1e6)
        self.m.lake_scrub_bytes.labels().inc(report.bytes_checked)
        self.last_scrub = report
        if report.failures:
            self.m.lake_errors.labels("scrub").inc(len(report.failures))
        return report

    def scrub_status(self) -> dict[str, object]:
        """The lake scrub in ``status``: its pace, and the last pass (None before one).
        ``check_every_s`` is how often each object is read at most apart, as the last
        pass shows it: the bound on a damaged object's exposure (docs/iceberg.md)."""
        cfg, last = self.tier.cfg.lake.scrub, self.last_scrub
        return {
            "rate_mb_per_s": cfg.rate_mb_per_s, "pass_interval_s": cfg.pass_interval_s,
            "last_pass_files": last.files_checked if last else None,
            "last_pass_bytes": last.bytes_checked if last else None,
            "last_pass_duration_ms": last.duration_ms if last else None,
            "corrupt_found": int(self.m.lake_objects_corrupt.total()),
            "check_every_s": round(max(cfg.pass_interval_s, last.duration_ms / 1000), 1)
            if last and cfg.rate_mb_per_s > 0 else None,
        }

    async def _scrub_due_in(self) -> float:
        """Seconds until the next scrub pass: ``pass_interval_s`` after the last finished
        one started (kept in <data_dir>/lake.scrub), so a daemon restarted often does not
        read the whole lake again at every start; soon when no pass ever ran, or to
        resume one a restart cut short (module doc)."""
        interval = self.tier.cfg.lake.scrub.pass_interval_s
        stamp = await anyio.to_thread.run_sync(_read_stamp, self.tier.data.lake_scrub)
        soon = max(MIN_GAP_S, min(interval, FIRST_RUN_MAX_S))
        if stamp is None:
            return soon
        start_ns, where = stamp
        if where != DONE:  # cut short by a restart, or failed (the store down): resume
            self._resume = (start_ns, "" if where == STARTED else where)
            return soon
        return max(MIN_GAP_S, (start_ns + interval * NS_PER_S - time.time_ns()) / NS_PER_S)

    async def _scrub_pass(self) -> ScrubReport:
        """A pass whose start, progress and end are recorded (module doc)."""
        start_ns, after = self._resume or (time.time_ns(), "")
        self._resume = None

        async def stamp(where: str) -> None:
            await anyio.to_thread.run_sync(atomic_write, self.tier.data.lake_scrub,
                                           f"{start_ns} {where}\n".encode())

        await stamp(after or STARTED)
        report = await self.scrub_once(after=after, progress=stamp)
        await stamp(DONE)
        return report

    async def _every(self, interval_s: float, job: Callable[[], Awaitable[object]],
                     kind: str, due_in: Callable[[], Awaitable[float]] | None = None
                     ) -> None:
        """``job`` on a timer; ``due_in`` (the scrub's) says when the next run is due
        instead, before the first run and after each one."""
        delay = min(interval_s, FIRST_RUN_MAX_S) if due_in is None else await due_in()
        while True:
            await anyio.sleep(delay)
            started = anyio.current_time()
            try:
                await job()
            except (LakeError, OSError, pa.ArrowException) as exc:
                self.m.lake_errors.labels(kind).inc()
                self.log.error("lake_janitor_run_failed", job=kind, error=str(exc),
                               retry_in_s=interval_s, hint=getattr(exc, "hint", "") or None)
            # From start to start: a run longer than the interval is followed at once
            # (after MIN_GAP_S, so an interval of 0 cannot spin on an empty lake).
            delay = max(MIN_GAP_S, started + interval_s - anyio.current_time()) \
                if due_in is None else await due_in()


def _read_stamp(path: Path) -> tuple[int, str] | None:
    """(start ns, where) from ``path``; None when absent or unreadable (then a pass runs
    soon). A file of the format before progress holds only the start: a finished pass."""
    try:
        start, _, where = path.read_text().strip().partition(" ")
        return int(start), where or DONE
    except (FileNotFoundError, ValueError):
        return None


__all__ = ["Janitor"]
