"""The janitor: reconcile this node's objects, the catalog's rows and the staging area.

    object store                                  catalog rows of this node
    client=<c>/slot=<s>/date=<d>/hour=<h>/        ◀──▶ object_key, state, updated_at
      <time>_<ulid>~<node_id>_stable.parquet
    client=<c>/slot=<s>/<node_id>/<file name>     (keys before issue 20: still this node's)
    (other nodes' objects are theirs: never judged; lake.partitions.is_node_key)

    finding                                        action
    object, no live row, older than grace_s ─────▶ orphan: object deleted
    row Registered, no object ───────────────────▶ reported + logged as an error; kept
    row Compacted, updated > delete_grace_s ago,
      no live Iceberg snapshot holds it ────────▶ object (+ local copy) deleted, row dropped
    row Abandoned, updated > grace_s ago ────────▶ object deleted if still there, row dropped
    row Quarantined or Lost, object at its key ──▶ kept: the restore target (an operator
                                                   put a backup there for `quiverd files
                                                   restore`), never an orphan
    staging/{active,stable}/ file, no live row,
      mtime older than min(grace_s, 1 h) ────────▶ deleted

A *live* row is Unfinished (Received .. Uploaded), Registered (MetaRegistered, Indexed,
Evicted), Quarantined or Lost (the key is where the file's restored copy goes), or
Compacted within ``compaction.delete_grace_s`` (readers in flight may still open the
replaced object). Why the grace for orphans: an upload writes its object
before its row names it (uploader: put, verify, then Uploaded), and a compaction writes
its output before ``replace``; an object younger than ``janitor.grace_s`` may be one of
those. An object's age is its last-modified time, or the ULID inside its file name when
the store gives none; an object with neither is never judged.

Nothing here can lose data: only objects no live row names are deleted, and a row
without its object is reported, never dropped (its bundles were acked: the object must
be put back, ``quiverd files restore FILE_ID --from PATH``). ``dry_run`` reports what a
sweep would do and deletes nothing.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import anyio
import msgspec
from ulid import ULID

from quiverd.kernel import fs
from quiverd.kernel.errors import CatalogUnavailable, LakeError
from quiverd.kernel.layout import TMP_SUFFIX
from quiverd.lake.model import (
    REGISTERED,
    RESTORABLE,
    UNFINISHED,
    FileRow,
    FileState,
    ObjectInfo,
)
from quiverd.lake.parquet import FileName, parse_file_name
from quiverd.lake.partitions import is_node_key
from quiverd.lake.tier import Tier

NS_PER_S = 1_000_000_000
Held = Callable[[list[FileRow]], Awaitable[set[str]]]  # rows -> ids a snapshot holds
LIST_LIMIT = 200_000  # rows and objects one sweep reads; more: orphans are not judged
DELETE_BATCH = 500  # row ids per delete_rows call
STAGING_GRACE_MAX_S = 3600  # staging files: min(janitor.grace_s, this)
MISSING_HINT = ("the catalog names an object the store no longer has: put a copy back with "
                "`quiverd files restore FILE_ID --from PATH` (a backup; it checks the size "
                "and CRC-32C), or restore the key from the store's versioning and run "
                "`quiverd files restore FILE_ID`; the janitor never drops such a row (its "
                "bundles were acked)")


class JanitorReport(msgspec.Struct, kw_only=True):
    """What one sweep found; with ``dry_run`` nothing listed here was deleted."""

    dry_run: bool
    orphan_objects: list[str] = msgspec.field(default_factory=list)  # keys deleted
    young_objects: list[str] = msgspec.field(default_factory=list)  # no row yet, in grace
    rows_missing_objects: list[str] = msgspec.field(default_factory=list)  # file ids
    compacted_removed: list[str] = msgspec.field(default_factory=list)  # file ids
    held_by_snapshots: list[str] = msgspec.field(default_factory=list)  # compacted, kept
    abandoned_removed: list[str] = msgspec.field(default_factory=list)  # file ids
    stale_staging_files: list[str] = msgspec.field(default_factory=list)  # paths
    stale_upload_temps: list[str] = msgspec.field(default_factory=list)  # fs store paths
    failures: list[str] = msgspec.field(default_factory=list)  # "<what>: <error>"
    objects_seen: int = 0
    rows_seen: int = 0
    truncated: bool = False  # a listing reached LIST_LIMIT: orphans were not judged
    duration_ms: float = 0.0


async def sweep(tier: Tier, *, dry_run: bool = False, now_ns: int | None = None,
                held: Held | None = None) -> JanitorReport:
    """One reconciliation pass over this node's objects and rows (module doc).
    ``held(rows)`` names the rows whose objects a live Iceberg snapshot still references
    (``lake.iceberg.held_by_snapshots``): those are kept until expiry frees them."""
    started = anyio.current_time()
    now = time.time_ns() if now_ns is None else now_ns
    lake = tier.cfg.lake
    grace_ns = lake.janitor.grace_s * NS_PER_S
    delete_grace_ns = lake.compaction.delete_grace_s * NS_PER_S
    report = JanitorReport(dry_run=dry_run)

    # Rows first: an object that appears after this listing is young, hence kept.
    rows = await tier.catalog.list_files(node_id=tier.node_id, limit=LIST_LIMIT)
    listed = await tier.store.list("", limit=LIST_LIMIT)
    objects = {o.key: o for o in listed if is_node_key(o.key, tier.node_id)}
    report.rows_seen, report.objects_seen = len(rows), len(objects)
    report.truncated = len(rows) >= LIST_LIMIT or len(listed) >= LIST_LIMIT

    live = {r.object_key for r in rows if r.object_key and _is_live(r, now, delete_grace_ns)}
    compacted = [r for r in rows if r.state is FileState.COMPACTED
                 and now - r.updated_at >= delete_grace_ns]
    if compacted and held is not None:
        kept = await held(compacted)
        report.held_by_snapshots = sorted(kept)
        live |= {r.object_key for r in compacted if r.file_id in kept}
        compacted = [r for r in compacted if r.file_id not in kept]
    abandoned = [r for r in rows if r.state is FileState.ABANDONED
                 and now - r.updated_at >= grace_ns]
    await _drop(tier, compacted, live, report.compacted_removed, report, dry_run)
    await _drop(tier, abandoned, live, report.abandoned_removed, report, dry_run)
    await _check_registered(tier, rows, objects, report)
    if report.truncated:
        tier.log.warning("lake_janitor_truncated", limit=LIST_LIMIT,
                         hint="more rows or objects than one sweep reads: orphans were not "
                         "judged; compaction lowers the file count")
    else:
        handled = {r.object_key for r in (*compacted, *abandoned)}
        # An object named after a file still being uploaded is its upload (whatever its
        # age: a stalled upload, or one whose verify failed and is being redone).
        uploading = {r.file_id for r in rows if r.state in UNFINISHED}
        await _orphans(tier, objects.values(), live | handled, uploading, now, grace_ns,
                       report, dry_run)
    await _staging(tier, min(lake.janitor.grace_s, STAGING_GRACE_MAX_S) * NS_PER_S, now,
                   report, dry_run)
    # A crash mid-upload leaves the fs store's temp file (uploads are temp + rename).
    report.stale_upload_temps = await tier.store.stale_temp_files(now - grace_ns,
                                                                  remove=not dry_run)

    report.duration_ms = round((anyio.current_time() - started) * 1000, 2)
    tier.log.info("lake_janitor_swept", dry_run=dry_run, rows=report.rows_seen,
                  objects=report.objects_seen, orphans=len(report.orphan_objects),
                  young_objects=len(report.young_objects),
                  rows_missing_objects=len(report.rows_missing_objects),
                  compacted_removed=len(report.compacted_removed),
                  abandoned_removed=len(report.abandoned_removed),
                  staging_removed=len(report.stale_staging_files),
                  upload_temps_removed=len(report.stale_upload_temps),
                  failures=len(report.failures), duration_ms=report.duration_ms)
    return report


def _is_live(row: FileRow, now_ns: int, delete_grace_ns: int) -> bool:
    if row.state in UNFINISHED or row.state in REGISTERED or row.state in RESTORABLE:
        return True
    return row.state is FileState.COMPACTED and now_ns - row.updated_at < delete_grace_ns


async def _drop(tier: Tier, rows: list[FileRow], live: set[str], done: list[str],
                report: JanitorReport, dry_run: bool) -> None:
    """Delete the objects (and local copies) of dead rows, then the rows themselves."""
    gone: list[str] = []
    for row in rows:
        try:
            # A key a live row names is never deleted (a key holds one file id, so this
            # is only a guard against a catalog edited by hand).
            if not dry_run and row.object_key and row.object_key not in live:
                await tier.store.delete(row.object_key)
            if not dry_run and row.local_path and row.source_id == tier.source_id:
                await anyio.to_thread.run_sync(_unlink, Path(row.local_path))
        except (LakeError, OSError) as exc:
            _failed(tier, report, f"{row.state.value} {row.file_id}", exc)
            continue
        gone.append(row.file_id)
    for i in range(0, len(gone), DELETE_BATCH):
        batch = gone[i:i + DELETE_BATCH]
        try:
            if not dry_run:
                await tier.catalog.delete_rows(batch)
        except LakeError as exc:
            _failed(tier, report, f"delete_rows x{len(batch)}", exc)
            continue
        done.extend(batch)


async def _check_registered(tier: Tier, rows: list[FileRow], objects: dict[str, ObjectInfo],
                            report: JanitorReport) -> None:
    """Registered rows whose object is missing: confirmed with a stat, then reported."""
    for row in rows:
        if row.state not in REGISTERED or row.object_key in objects:
            continue
        try:
            found = await tier.store.stat(row.object_key) if row.object_key else None
        except LakeError as exc:
            _failed(tier, report, f"stat {row.object_key}", exc)
            continue
        if found is None:
            report.rows_missing_objects.append(row.file_id)
            tier.log.error("lake_row_missing_object", file_id=row.file_id,
                           client=row.client_name, state=row.state.value,
                           object_key=row.object_key or None, uri=row.uri or None,
                           rows=row.row_count, hint=MISSING_HINT)


async def _orphans(tier: Tier, objects: Iterable[ObjectInfo], referenced: set[str],
                   uploading: set[str], now_ns: int, grace_ns: int, report: JanitorReport,
                   dry_run: bool) -> None:
    for obj in objects:
        if obj.key in referenced:
            continue
        born = _born_ns(obj)
        name = parse_file_name(obj.key.rsplit("/", 1)[-1])
        if born is None or now_ns - born < grace_ns or (name and name.ulid in uploading):
            report.young_objects.append(obj.key)
            continue
        try:
            if not dry_run:
                # Judged an orphan from the listing: each attempt (a timed-out delete is
                # retried) first asks the catalog again, for the upload may have been
                # redone and registered at this key since (tests/sim/detsim, seed 11).
                await tier.store.delete(obj.key, still=_still_orphan(tier, obj.key, name))
        except LakeError as exc:
            _failed(tier, report, f"orphan {obj.key}", exc)
            continue
        report.orphan_objects.append(obj.key)
        tier.log.warning("lake_orphan_deleted" if not dry_run else "lake_orphan_found",
                         key=obj.key, bytes=obj.size, age_s=(now_ns - born) // NS_PER_S)


def _still_orphan(tier: Tier, key: str, name: FileName | None) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        if name is None:
            return True
        try:
            row = await tier.catalog.get(name.ulid)
        except CatalogUnavailable:  # unsure: keep it, the next sweep judges again
            return False
        return row is None or (row.state is FileState.ABANDONED) or (
            row.object_key not in ("", None, key))
    return check


def _born_ns(obj: ObjectInfo) -> int | None:
    """The object's last-modified time, else its file id's (ULID) time; None if neither."""
    if obj.last_modified_ns:
        return obj.last_modified_ns
    parsed = parse_file_name(obj.key.rsplit("/", 1)[-1])
    if parsed is None:
        return None
    try:
        return ULID.from_str(parsed.ulid).milliseconds * 1_000_000
    except ValueError:  # 26 valid characters, yet past the ULID range
        return None


async def _staging(tier: Tier, grace_ns: int, now_ns: int, report: JanitorReport,
                   dry_run: bool) -> None:
    """Staging files of no live row of this data directory, untouched for the grace."""
    rows = await tier.catalog.list_files(source_id=tier.source_id,
                                         states=UNFINISHED | REGISTERED)
    live_ids = {r.file_id for r in rows}
    dirs = (tier.data.staging_active, tier.data.staging_stable)
    removed = await anyio.to_thread.run_sync(_clear_stale, dirs, live_ids, now_ns - grace_ns,
                                             dry_run)
    report.stale_staging_files.extend(str(p) for p in removed)
    for path in removed:
        tier.log.warning("lake_staging_file_removed" if not dry_run else "lake_staging_stale",
                         path=str(path))


def _clear_stale(dirs: Iterable[Path], live_ids: set[str], cutoff_ns: int,
                 dry_run: bool) -> list[Path]:
    """Regular files whose name names no live file id and whose mtime is before cutoff."""
    stale: list[Path] = []
    for directory in dirs:
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_mtime_ns >= cutoff_ns:
                continue
            # A download's or a crash-safe write's temp file (<name>.tmp) is its file's.
            name = entry.name.removesuffix(TMP_SUFFIX)
            parsed = parse_file_name(name)
            if parsed is not None and parsed.ulid in live_ids:
                continue
            if not dry_run:
                _unlink(Path(entry.path))
            stale.append(Path(entry.path))
    return stale


def _failed(tier: Tier, report: JanitorReport, what: str, exc: Exception) -> None:
    report.failures.append(f"{what}: {exc}")
    tier.log.warning("lake_janitor_step_failed", what=what, error=str(exc),
                     hint=getattr(exc, "hint", "") or None)


def _unlink(path: Path) -> None:
    fs.active().unlink(path, missing_ok=True)


__all__ = ["JanitorReport", "sweep"]
