"""Projector: registered lake files in, Iceberg snapshots out (SPEC §6, "Iceberg projection").

    publisher ──registered(row)──▶ pending (bounded, never waits) ──▶ gather linger_ms
                                                                        │ group by table
    janitor (compaction done) ──nudge()──▶ reconcile                    ▼
    timer reconcile_interval_s ──────────▶ reconcile ──▶ Projection.commit: one snapshot
                                                         per table per round, in the
                                                         worker process (iceberg.remote)

quiverd's catalog is the source of truth; the Iceberg tables are a projection of it.
Each round commits every file gathered since the last one: one snapshot per table,
whose summary names the quiverd file ids. The uploader never waits on the projection:
``registered`` records the file (its wait is the lag ``status`` shows) or, past
``PENDING_MAX``, asks for a reconcile pass, which finds the file in the catalog.
Rounds are spaced so commits take at most ``DUTY`` of the time (more files per snapshot
under load).

The reconciler (5 s after the start, on its timer, after a compaction, after a failed
round, and when files were not recorded) compares, per table this source has files
in, this source's registered files with the table's current
snapshot: registered files missing from it are added, files of this source that the
catalog no longer holds as live (compacted) are removed, both in one snapshot (so a
compaction is one replace). It only ever touches this source's files, so several
daemons on one catalog never remove or add each other's; their commits race through
Iceberg's compare-and-swap, retried in ``Projection.commit``. Commits and reconcile
passes run one at a time (a single task), and a file a pass added is not added again
by its late notice, so a file is never added twice by one daemon. After each pass
snapshots older than ``keep_snapshots_s`` are expired.

A file Iceberg cannot hold (a ``timestamp[ns]`` column kept for precision, a type
change Iceberg cannot express) is *skipped*: logged once, counted
(``quiver_lake_iceberg_skipped_total{reason}``), and remembered so no pass retries it.
A failing commit (catalog or store down) marks the lake's ``iceberg`` part degraded,
keeps the files pending and retries with backoff; ingest and upload go on.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import anyio

from quiverd.kernel.backoff import backoff_s
from quiverd.kernel.config import IcebergConfig
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import Metrics
from quiverd.lake.health import LakeHealth
from quiverd.lake.iceberg import CommitResult, DataFileRef, table_name
from quiverd.lake.iceberg.held import held_ids
from quiverd.lake.iceberg.remote import RemoteProjection
from quiverd.lake.model import REGISTERED, UNFINISHED, FileRow, FileState
from quiverd.lake.tier import Tier

DUTY = 0.1  # at most this share of the time goes to commits (rounds are spaced)
FIRST_RECONCILE_MAX_S = 5.0
PENDING_MAX = 100_000  # files waiting for a snapshot; past it the reconciler finds them
NS_PER_S = 1_000_000_000
ADDED_KEPT = 100_000  # ids of files committed lately, kept against a late notice
RECENT_COMMITS = 1000  # status's commit p99 is over the last this many commits


class Pending:
    """Files waiting for their snapshot, per table, with when each was registered."""

    def __init__(self) -> None:
        self.by_table: dict[str, dict[str, FileRow]] = defaultdict(dict)
        self.since_ns: dict[str, int] = {}  # file id -> wall ns it became pending

    def add(self, row: FileRow, since_ns: int) -> None:
        self.by_table[table_name(row.client_name, row.slot)][row.file_id] = row
        self.since_ns.setdefault(row.file_id, since_ns)

    def done(self, file_ids: list[str]) -> None:
        for fid in file_ids:
            self.since_ns.pop(fid, None)
        for table in list(self.by_table):
            files = self.by_table[table]
            for fid in file_ids:
                files.pop(fid, None)
            if not files:
                del self.by_table[table]

    def oldest_ns(self) -> int | None:
        return min(self.since_ns.values(), default=None)

    def __len__(self) -> int:
        return len(self.since_ns)


class Projector:
    def __init__(self, tier: Tier, projection: RemoteProjection, *, log: Logger,
                 metrics: Metrics, health: LakeHealth) -> None:
        self.tier, self.log, self.m = tier, log, metrics
        self.projection = projection  # in a worker process (lake.iceberg.remote)
        self.health = health
        self.cfg: IcebergConfig = tier.cfg.lake.iceberg
        self.time_column = tier.cfg.lake.time_column
        self.pending = Pending()  # registered, not yet committed (what status calls lag)
        self.wake = anyio.Event()  # set by a notice or a reconcile request
        self.reconcile_due = False
        self.round_commit_s = 0.0  # commit time of the current round (the duty cycle)
        self.skipped: dict[str, str] = {}  # file id -> reason, never tried again
        # Files this projector committed lately: a notice can still be queued for a file
        # a reconcile pass already added (registered before its catalog listing, noticed
        # after), and must not add it twice.
        self.added: dict[str, float] = {}  # file id -> monotonic time of its commit
        self.commits = 0
        self.snapshots_expired = 0
        self.last_commit_s: float | None = None
        self.recent_commit_s: deque[float] = deque(maxlen=RECENT_COMMITS)
        self.last_reconcile_ns: int | None = None
        self.last_error: str | None = None

    # ---- inputs (event loop, never wait) -------------------------------------------
    def registered(self, row: FileRow) -> None:
        """A file was registered in quiverd's catalog: project it in the next round."""
        if len(self.pending) >= PENDING_MAX:
            self.nudge()  # too many waiting: the reconciler finds it in the catalog
            return
        self.pending.add(row, time.time_ns())
        self.wake.set()

    def nudge(self) -> None:
        """Reconcile soon (after a compaction, or when a file was not recorded)."""
        self.reconcile_due = True
        self.wake.set()

    # ---- the actor -------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._first_reconcile)
            tg.start_soon(self._timer)
            task_status.started()
            try:
                await self._rounds()
            finally:
                tg.cancel_scope.cancel()

    async def _first_reconcile(self) -> None:
        """Files registered before a crash and compactions since, soon after the start
        (not at once: a restarted daemon's backlog goes to the uploader first)."""
        await anyio.sleep(min(self.cfg.reconcile_interval_s, FIRST_RECONCILE_MAX_S))
        self.nudge()

    async def _timer(self) -> None:
        while True:
            await anyio.sleep(self.cfg.reconcile_interval_s)
            self.nudge()

    async def _rounds(self) -> None:
        attempt = 0
        while True:
            await self._gather()
            self.round_commit_s = 0.0
            try:
                if self.reconcile_due:
                    self.reconcile_due = False
                    await self.reconcile()
                await self._commit_pending()
            except Exception as exc:  # noqa: BLE001 - the projection never stops the lake
                attempt += 1
                delay = backoff_s(attempt)
                # A commit cut off by a catalog or store failure may have landed: the
                # next round reconciles first, so pending files are not added twice.
                self.nudge()
                self.last_error = str(exc)
                self.m.lake_errors.labels("iceberg").inc()
                self.health.fail("iceberg", "unavailable", exc)
                self.log.warning("iceberg_commit_failed", error=str(exc), pending=len(self.pending),
                                 retry_in_s=round(delay, 2))
                await anyio.sleep(delay)
                continue
            if attempt:
                attempt = 0
                self.health.ok("iceberg")
                self.last_error = None
            self._gauges()
            # Commits cost CPU (in the worker process) that the uploader would use:
            # rounds are spaced so commits take at most DUTY of the time, at the cost of
            # more files per snapshot under load.
            await anyio.sleep(self.round_commit_s * (1 / DUTY - 1))

    async def _gather(self) -> None:
        """Wait for a notice or a reconcile request, then linger to fill the round."""
        if not len(self.pending) and not self.reconcile_due:
            with anyio.move_on_after(self.cfg.reconcile_interval_s):
                await self.wake.wait()
        self.wake = anyio.Event()
        await anyio.sleep(self.cfg.linger_ms / 1000)

    # ---- commits ---------------------------------------------------------------------
    async def _commit_pending(self) -> None:
        for table in list(self.pending.by_table):
            files = dict(self.pending.by_table.get(table, {}))  # notices may come meanwhile
            rows = [r for r in files.values()
                    if r.file_id not in self.skipped and r.file_id not in self.added]
            if rows:
                await self._commit(table, rows, [], kind="append")
            self.pending.done(list(files))
            self._gauges()

    async def _commit(self, table: str, add: list[FileRow], remove: list[str], *,
                      kind: str) -> CommitResult:
        refs = [self._ref(r) for r in add]
        summary = {"quiverd.source-id": self.tier.source_id, "quiverd.node-id": self.tier.node_id,
                   "quiverd.kind": kind}
        result = await self.projection.commit(table, refs, remove, summary=summary)
        self.commits += 1
        now = time.monotonic()
        self.added.update(dict.fromkeys(result.added, now))
        if len(self.added) > ADDED_KEPT:  # oldest first (insertion order)
            for fid in list(self.added)[:len(self.added) - ADDED_KEPT]:
                del self.added[fid]
        self.last_commit_s = result.took_s
        self.round_commit_s += result.took_s
        self.recent_commit_s.append(result.took_s)
        self.m.lake_iceberg_commit_latency.observe(result.took_s)
        self.m.lake_iceberg_commits.labels(kind).inc()
        self.m.lake_iceberg_files.labels("added").inc(len(result.added))
        self.m.lake_iceberg_files.labels("removed").inc(len(result.removed))
        for file_id, reason in result.skipped:
            if file_id not in self.skipped:
                self.skipped[file_id] = reason
                self.m.lake_iceberg_skipped.labels(_reason_kind(reason)).inc()
                self.log.warning("iceberg_file_skipped", table=table, file_id=file_id,
                                 reason=reason)
        self.log.info("iceberg_committed", table=table, kind=kind, snapshot=result.snapshot_id,
                      added=len(result.added), removed=len(result.removed),
                      skipped=len(result.skipped), retries=result.retries,
                      took_ms=round(result.took_s * 1000, 1))
        return result

    def _ref(self, row: FileRow) -> DataFileRef:
        return DataFileRef(file_id=row.file_id, location=self.tier.store.location(row.object_key),
                           client=row.client_name, slot=row.slot,
                           partition_column=self.time_column)

    # ---- the reconciler ----------------------------------------------------------------
    async def reconcile(self) -> None:
        """Make each table's current snapshot hold exactly this source's live files."""
        mine = await self.tier.catalog.list_files(source_id=self.tier.source_id)
        not_live = {r.file_id for r in mine if r.state not in REGISTERED}
        want: dict[str, dict[str, FileRow]] = defaultdict(dict)
        for row in mine:
            if row.state in REGISTERED and row.file_id not in self.skipped:
                want[table_name(row.client_name, row.slot)][row.file_id] = row
        # Only tables this source has ever registered files in: a daemon that never
        # registered a file does not start the projection's worker process at all.
        tables = {table_name(r.client_name, r.slot) for r in mine
                  if r.state not in UNFINISHED and r.state is not FileState.ABANDONED}
        for table in sorted(tables):
            present = await self.projection.live_locations(table)
            wanted = want.get(table, {})
            present_ids = set(present.values())
            add = [r for fid, r in wanted.items() if fid not in present_ids]
            # Of the files the snapshot holds, this source's that the catalog no longer
            # holds as live (compacted): those leave the table, in the same snapshot.
            remove = [loc for loc, fid in present.items() if fid in not_live]
            if add or remove:
                await self._commit(table, add, remove,
                                   kind="replace" if remove else "reconcile")
                self.log.info("iceberg_reconciled", table=table, added=len(add),
                              removed=len(remove))
            self.pending.done(list(wanted))
            expired = await self.projection.expire(table, older_than_s=self.cfg.keep_snapshots_s)
            self.snapshots_expired += expired
        self.last_reconcile_ns = time.time_ns()

    # ---- what the janitor asks ---------------------------------------------------------
    async def referenced(self, rows: list[FileRow]) -> set[str]:
        """Ids of ``rows`` whose object a live (unexpired) snapshot still references:
        the janitor keeps those objects. On any error every one counts as referenced."""
        try:
            return await held_ids(self.projection.referenced_locations,
                                  self.tier.store.location, rows)
        except Exception as exc:  # noqa: BLE001 - unknown means keep
            self.log.warning("iceberg_references_unknown", files=len(rows), error=str(exc))
            return {r.file_id for r in rows}

    # ---- status ------------------------------------------------------------------------
    def _gauges(self) -> None:
        self.m.lake_iceberg_lag_files.labels().set(len(self.pending))
        self.m.lake_iceberg_lag_seconds.labels().set(self.lag_s())

    def lag_s(self) -> float:
        oldest = self.pending.oldest_ns()
        return 0.0 if oldest is None else max(0.0, (time.time_ns() - oldest) / NS_PER_S)

    def status(self) -> dict[str, object]:
        recent = sorted(self.recent_commit_s)
        p99 = recent[min(len(recent) - 1, int(len(recent) * 0.99))] if recent else None
        return {
            "enabled": True,
            "lag_files": len(self.pending),
            "lag_s": round(self.lag_s(), 3),
            "commits": self.commits,
            "last_commit_ms": None if self.last_commit_s is None
            else round(self.last_commit_s * 1000, 1),
            "commit_p99_ms": None if p99 is None else round(p99 * 1000, 1),
            "files_skipped": len(self.skipped),
            "snapshots_expired": self.snapshots_expired,
            "last_reconcile_ns": self.last_reconcile_ns,
            "last_error": self.last_error,
        }


def _reason_kind(reason: str) -> str:
    """The metric label of a skip reason: its first word (``timestamp_ns``, ...)."""
    return reason.split(":", 1)[0].split()[0] if reason else "unknown"


__all__ = ["Projector"]
