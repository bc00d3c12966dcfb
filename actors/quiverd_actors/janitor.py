"""Janitor: timers in, a reconciled lake out (orphans deleted, small files compacted).

    every lake.janitor.interval_s     ──▶ lake.janitor.sweep     (objects <-> rows, staging)
    every lake.compaction.interval_s  ──▶ lake.compaction.compact (small files -> larger)

Both are periodic work with nothing to consume, so each runs on its own timer (0 turns
it off; ``quiverd janitor`` / ``quiverd compact`` still run it by hand). The first run
comes ``min(interval, FIRST_RUN_MAX_S)`` after the start, so a daemon restarted more
often than the interval still gets swept. A failed run is logged, counted in
``quiver_lake_errors_total{kind="janitor"|"compaction"}``, and retried at the next tick;
rows whose object is missing are counted under ``kind="missing_object"`` at every sweep
that finds them. ``last_report`` and ``last_compaction`` are what the status command shows.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pyarrow as pa

from quiverd.kernel.errors import LakeError
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import Metrics
from quiverd.lake.compaction import CompactionResult, compact
from quiverd.lake.janitor import JanitorReport, sweep
from quiverd.lake.tier import Tier

FIRST_RUN_MAX_S = 60.0


class Janitor:
    def __init__(self, tier: Tier, *, log: Logger, metrics: Metrics) -> None:
        self.tier, self.log, self.m = tier, log, metrics
        # Compaction's Parquet work runs in these threads (reads, zstd: GIL released).
        self.limiter = anyio.CapacityLimiter(max(1, tier.cfg.lake.compaction.parallelism))
        self.last_report: JanitorReport | None = None
        self.last_compaction: list[CompactionResult] = []

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
            task_status.started()

    async def sweep_once(self) -> JanitorReport:
        report = await sweep(self.tier)
        self.last_report = report
        if report.rows_missing_objects:
            self.m.lake_errors.labels("missing_object").inc(len(report.rows_missing_objects))
        if report.failures:
            self.m.lake_errors.labels("janitor").inc(len(report.failures))
        return report

    async def compact_once(self) -> list[CompactionResult]:
        results = await compact(self.tier, limiter=self.limiter, log=self.log)
        self.last_compaction = results
        failed = sum(1 for r in results if r.outcome == "failed")
        if failed:
            self.m.lake_errors.labels("compaction").inc(failed)
        return results

    async def _every(self, interval_s: float, job: Callable[[], Awaitable[object]],
                     kind: str) -> None:
        delay = min(interval_s, FIRST_RUN_MAX_S)
        while True:
            await anyio.sleep(delay)
            delay = interval_s
            try:
                await job()
            except (LakeError, OSError, pa.ArrowException) as exc:
                self.m.lake_errors.labels(kind).inc()
                self.log.error("lake_janitor_run_failed", job=kind, error=str(exc),
                               retry_in_s=interval_s, hint=getattr(exc, "hint", "") or None)


__all__ = ["Janitor"]
