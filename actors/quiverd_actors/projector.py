"""Projector: registered lake files in, Iceberg snapshots out (SPEC §6, "Iceberg projection").

    publisher ──registered(row)──▶ pending (bounded, never waits) ──▶ gather linger_ms
                                                                        │ group by table
    janitor (compaction done) ──nudge()──▶ reconcile                    ▼
    timer reconcile_interval_s ──────────▶ reconcile ──▶ Projection.commit: one snapshot
                                                         per table per round, in the
                                                         worker process (iceberg.remote)

quiverd's catalog is the source of truth; the Iceberg tables are a projection of it.
Every commit is a sync of one table: the projector reads this source's rows of the
table from the catalog (its registered files and the ones compacted, quarantined or
abandoned), then ``Projection.sync`` diffs them against the table's current snapshot
inside the compare-and-swap and adds what is registered and missing and deletes what is
no longer live, in one snapshot. So after every commit the source's files in the table
are exactly its registered files as of a catalog read made just before: a file a
compaction replaced between its notice and its commit is never added (the old queued
append re-added replaced files next to their replacement, rows twice until the next
reconcile), and a compaction is one replace. A notice only says which table to sync.

Each table carries this source's commit count (``quiverd.commits.<source id>``), the
fence: a sync names the count it last saw, read before its catalog read, and changes
nothing when the table holds another, because then a commit of this source landed that
its catalog read may predate (a killed daemon's worker finishing late). The projector
then reads the count and the catalog again. Only this source's files are ever touched,
so several daemons on one catalog never remove or add each other's; their commits race
through Iceberg's compare-and-swap, retried in ``Projection.sync``. Commits and reconcile
passes run one at a time (a single task). The uploader never waits on the projection:
``registered`` records the file (its wait is the lag ``status`` shows) or, past
``PENDING_MAX``, asks for a reconcile pass. Rounds are spaced so commits take at most
``DUTY`` of the time (more files per snapshot under load).

The reconciler (5 s after the start, on its timer, after a compaction, after a failed
round, and when files were not recorded) syncs every table this source has files in,
then expires the snapshots that stopped being current over ``keep_snapshots_s`` ago.

A file Iceberg cannot hold (a ``timestamp[ns]`` column kept for precision, a type
change Iceberg cannot express) is *skipped*: logged once, counted
(``quiver_lake_iceberg_skipped_total{reason}``), and remembered so no pass retries it.
A file whose object is absent or unreadable is left out of this commit only (logged).
A failing commit (catalog or store down) marks the lake's ``iceberg`` part degraded,
keeps the files pending and retries with backoff; ingest and upload go on.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import anyio

from quiverd.kernel.backoff import backoff_s
from quiverd.kernel.config import IcebergConfig
from quiverd.kernel.errors import IcebergCommitFailed
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import Metrics
from quiverd.lake.footers import Footers
from quiverd.lake.health import LakeHealth
from quiverd.lake.iceberg import CommitResult, DataFileRef, table_name
from quiverd.lake.iceberg.held import held_ids
from quiverd.lake.iceberg.remote import RemoteProjection
from quiverd.lake.model import REGISTERED, UNFINISHED, FileRow, FileState
from quiverd.lake.tier import Tier

# At most this share of the time goes to commits (rounds are spaced): 0.25, so a round
# of 0.2 s commits waits 0.6 s for the next (0.1 waited 1.8 s: seconds of freshness).
DUTY = 0.25
FIRST_RECONCILE_MAX_S = 5.0
PENDING_MAX = 100_000  # files waiting for a snapshot; past it the reconciler finds them
NS_PER_S = 1_000_000_000
SKIPPED_KEPT = 100_000  # verdicts on files Iceberg cannot hold (oldest forgotten first)
FENCED_RETRIES = 3  # a sync fenced off reads the count and the catalog again this often
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
                 metrics: Metrics, health: LakeHealth, footers: Footers | None = None) -> None:
        self.tier, self.log, self.m = tier, log, metrics
        # The uploader's footers (reader "projector"): sent with the refs, so the worker
        # does not read the objects back.
        self.footers = footers
        self.projection = projection  # in a worker process (lake.iceberg.remote)
        self.health = health
        self.cfg: IcebergConfig = tier.cfg.lake.iceberg
        self.time_column = tier.cfg.lake.time_column
        self.pending = Pending()  # registered, not yet committed (what status calls lag)
        self.overflowed_ns = 0  # wall ns a notice last found pending full (not tracked)
        self.reconciled_from_ns = 0  # start of the last completed reconcile pass
        self.round_done = anyio.Event()  # set (and replaced) after each successful round
        self.wake = anyio.Event()  # set by a notice or a reconcile request
        self.reconcile_due = False
        self.round_commit_s = 0.0  # commit time of the current round (the duty cycle)
        self.skipped: dict[str, str] = {}  # file id -> reason, never tried again
        # table -> {file id: rows} of its registered files it cannot hold (status shows it)
        self.skipped_by_table: dict[str, dict[str, int]] = {}
        self.missing: set[str] = set()  # files left out for want of an object (logged once)
        # table -> this source's commit count the table held after our last sync (the
        # fence's base); absent until read, and dropped when a sync's outcome is unknown.
        self.commit_counts: dict[str, int] = {}
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
            self.overflowed_ns = time.time_ns()
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
                await self.round_once()
            except Exception as exc:  # noqa: BLE001 - the projection never stops the lake
                attempt += 1
                delay = backoff_s(attempt)
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
            self.round_done.set()
            self.round_done = anyio.Event()
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
    async def round_once(self) -> None:
        """One round: a reconcile pass when one is due, then a sync of every table with
        files noticed since the last round."""
        if self.reconcile_due:
            self.reconcile_due = False
            await self.reconcile()
        for table in list(self.pending.by_table):
            files = self.pending.by_table.get(table)
            if not files:
                continue
            taken = list(files)  # notices may come meanwhile: they wait for the next round
            row = files[taken[0]]
            await self._sync_table(table, row.client_name, row.slot, kind="append")
            self.pending.done(taken)
            self._gauges()

    async def _sync_table(self, table: str, client: str, slot: int, *, kind: str,
                          rows: list[FileRow] | None = None) -> CommitResult:
        """Sync ``table`` with this source's rows of it: ``rows`` when the caller read
        them after this table's commit count was known, else read here."""
        for attempt in range(FENCED_RETRIES + 1):
            base = self.commit_counts.get(table)
            if base is None:
                # Read before the catalog, so that any commit landing after the catalog
                # read is one the fence sees.
                base = await self.projection.source_commits(table, self.tier.source_id)
                self.commit_counts[table] = base
                rows = None
            if rows is None:
                rows = await self.tier.catalog.list_files(client=client, slot=slot,
                                                          source_id=self.tier.source_id)
            result = await self._commit(table, rows, base, kind=kind)
            if not result.stale:
                return result
            self.commit_counts.pop(table, None)
            rows = None
            self.log.warning("iceberg_commit_fenced", table=table, base=base,
                             table_commits=result.commits, attempt=attempt + 1,
                             hint="another process committed this source's files to the "
                             "table (a killed daemon's worker?): reading the catalog again")
        raise IcebergCommitFailed(f"Iceberg sync of {table} was fenced off "
                                  f"{FENCED_RETRIES + 1} times: another process keeps "
                                  "committing this source's files")

    async def _commit(self, table: str, rows: list[FileRow], base: int, *,
                      kind: str) -> CommitResult:
        want = [self._ref(r) for r in rows
                if r.state in REGISTERED and r.file_id not in self.skipped]
        gone = [r.file_id for r in rows if r.state not in REGISTERED]
        known = {r.file_id: r.row_count for r in rows
                 if r.state in REGISTERED and r.file_id in self.skipped}
        summary = {"quiverd.source-id": self.tier.source_id, "quiverd.node-id": self.tier.node_id,
                   "quiverd.kind": kind}
        try:
            result = await self.projection.sync(table, want, gone, source=self.tier.source_id,
                                                base=base, summary=summary, known_skipped=known)
        except BaseException:
            self.commit_counts.pop(table, None)  # it may have landed: read the count again
            raise
        if result.stale:
            return result
        self._footers_done(want, result)
        self.commit_counts[table] = result.commits
        if result.snapshot_id is not None:
            self._committed(table, result, "replace" if result.removed else kind)
        row_counts = {r.file_id: r.row_count for r in rows}
        self._skips(table, result, row_counts)
        known.update((fid, row_counts.get(fid, 0)) for fid, _ in result.skipped)
        if known:
            self.skipped_by_table[table] = known
        else:
            self.skipped_by_table.pop(table, None)
        return result

    def _committed(self, table: str, result: CommitResult, kind: str) -> None:
        self.commits += 1
        self.last_commit_s = result.took_s
        self.round_commit_s += result.took_s
        self.recent_commit_s.append(result.took_s)
        self.m.lake_iceberg_commit_latency.observe(result.took_s)
        self.m.lake_iceberg_commits.labels(kind).inc()
        self.m.lake_iceberg_files.labels("added").inc(len(result.added))
        self.m.lake_iceberg_files.labels("removed").inc(len(result.removed))
        self.log.info("iceberg_committed", table=table, kind=kind, snapshot=result.snapshot_id,
                      added=len(result.added), removed=len(result.removed),
                      skipped=len(result.skipped), retries=result.retries,
                      took_ms=round(result.took_s * 1000, 1))

    def _skips(self, table: str, result: CommitResult, row_counts: dict[str, int]) -> None:
        for file_id, reason in result.skipped:
            if file_id not in self.skipped:
                if len(self.skipped) >= SKIPPED_KEPT:
                    del self.skipped[next(iter(self.skipped))]
                self.skipped[file_id] = reason
                self.m.lake_iceberg_skipped.labels(_reason_kind(reason)).inc()
                self.log.warning("iceberg_file_skipped", table=table, file_id=file_id,
                                 rows=row_counts.get(file_id), reason=reason,
                                 hint="Iceberg readers of the table lack these rows; "
                                 'spark.read.format("quiver") reads them')
        for file_id, reason in result.missing:
            if file_id not in self.missing and len(self.missing) < SKIPPED_KEPT:
                self.missing.add(file_id)
                self.log.warning("iceberg_file_missing", table=table, file_id=file_id,
                                 reason=reason, hint="left out of the table until its "
                                 "object can be read")

    def _ref(self, row: FileRow) -> DataFileRef:
        footer = self.footers.peek(row.file_id) if self.footers is not None else b""
        return DataFileRef(file_id=row.file_id, location=self.tier.store.location(row.object_key),
                           client=row.client_name, slot=row.slot,
                           partition_column=self.time_column, footer=footer,
                           size=row.compressed_size if footer else 0)

    def _footers_done(self, want: list[DataFileRef], result: CommitResult) -> None:
        """After a sync that was not fenced off every wanted file is in the table, skipped
        or missing: the footers are needed no more. A file sent with its footer is
        missing only when that footer did not decode: the next sync reads the object."""
        if self.footers is None:
            return
        missing = {fid for fid, _ in result.missing}
        for ref in want:
            if ref.file_id in missing:
                self.footers.forget(ref.file_id)
            elif ref.footer:
                self.footers.done(ref.file_id, "projector")

    # ---- the reconciler ----------------------------------------------------------------
    async def reconcile(self) -> None:
        """Sync every table this source has files in, then expire old snapshots."""
        # What was noticed before the catalog read is in it: done once its table synced.
        started_ns = time.time_ns()
        noticed = {table: list(files) for table, files in self.pending.by_table.items()}
        mine = await self.tier.catalog.list_files(source_id=self.tier.source_id)
        by_table: dict[str, list[FileRow]] = defaultdict(list)
        for row in mine:
            by_table[table_name(row.client_name, row.slot)].append(row)
        # Only tables this source has ever registered files in: a daemon that never
        # registered a file does not start the projection's worker process at all.
        for table, rows in sorted(by_table.items()):
            if not any(r.state not in UNFINISHED and r.state is not FileState.ABANDONED
                       for r in rows):
                continue
            await self._sync_table(table, rows[0].client_name, rows[0].slot, kind="reconcile",
                                   rows=rows if table in self.commit_counts else None)
            self.pending.done(noticed.get(table, []))
            expired = await self.projection.expire(table, older_than_s=self.cfg.keep_snapshots_s)
            self.snapshots_expired += expired
        self.last_reconcile_ns = time.time_ns()
        self.reconciled_from_ns = started_ns  # files registered before it are in a snapshot

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

    async def projected_through(self, t_ns: int) -> None:
        """Until every file registered (noticed here) at or before wall time ``t_ns`` is
        in a committed snapshot, or left out of every table for good (skipped). A notice
        the full pending set did not take is found by the next reconcile: then until a
        reconcile pass that started after it."""
        while True:
            oldest = self.pending.oldest_ns()
            overflow = 0 < self.overflowed_ns <= t_ns and \
                self.reconciled_from_ns <= self.overflowed_ns
            if (oldest is None or oldest > t_ns) and not overflow:
                return
            await self.round_done.wait()

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
            "files_skipped": sum(len(f) for f in self.skipped_by_table.values()),
            "skipped": {table: {"files": len(files), "rows": sum(files.values())}
                        for table, files in sorted(self.skipped_by_table.items())},
            "snapshots_expired": self.snapshots_expired,
            "last_reconcile_ns": self.last_reconcile_ns,
            "last_error": self.last_error,
        }


def _reason_kind(reason: str) -> str:
    """The metric label of a skip reason: its first word (``timestamp_ns``, ...)."""
    return reason.split(":", 1)[0].split()[0] if reason else "unknown"


__all__ = ["Projector"]
