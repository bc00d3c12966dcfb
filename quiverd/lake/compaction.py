"""Compaction: many small registered files of one (client, slot, shard, hour) -> one larger
file, under the same hour's key.

    catalog: this source's Registered files < small_file_bytes
        │ group by (client, slot, shard, hour partition of the object key): files of
        │ different hours never merge (a file never spans two hours, lake.partitions);
        │ keys of the layout before hours are left as they are (their hours are unknown)
        │ groups of >= min_files, oldest first (start_ts)
        ▼ split into tasks: <= max_files, <= memory_limit_bytes of Arrow bytes,
    task    about lake.file_size_bytes of Parquet out
        │ fetch   local copy hard-linked, else downloaded   staging/active/<input name>
        │ schema  unify the inputs' schemas; an input that cannot be unified starts a
        │         new output (runs of one file are left alone)
        │ write   read, conform, append (row groups of ~row_group_bytes), close,
        │         rename Active -> Stable, fsync            staging/stable/<new name>
        │ upload  put_file (conditional create + verify)    client=<c>/slot=<s>/date=<d>/
        │                                                   hour=<h>/<new name>
        ▼ replace catalog.replace(old ids, new row): one transaction; the new row is
                  MetaRegistered and takes the inputs' coverage, the inputs become Compacted

The replaced objects are not deleted here: a reader may have listed them a moment ago.
The janitor deletes them ``compaction.delete_grace_s`` after the replace. On
``ReplaceConflict`` (another compaction replaced an input first) the new object and
file are deleted and the inputs are left as they are. When the outcome of ``replace``
is unknown (the catalog kept failing), the new object and file are left: a committed
replace names them, and otherwise the janitor finds an orphan object and a stale file.

Before its output is written, the task inserts the output's row as Received (unfinished):
the janitor never judges an object or a staging file named after an unfinished row an
orphan, so a sweep with a short ``lake.janitor.grace_s`` cannot delete them in flight
(it did at ``grace_s = 0``: the lake crash states). A task that fails or conflicts
abandons that row; one whose replace has an unknown outcome leaves it (a start abandons
an unfinished row).

The new file keeps its local copy (``local_path``) like a freshly uploaded one: the
indexer reads its zone maps from it, then evicts it under ``lake.delete_after_upload`` /
``local_retention_s``. Inputs are read from task-private files named after their own
file ids (hard links of local copies, or downloads): the indexer may evict a local copy
mid-task without harm, the janitor keeps a staging file whose id is registered, and
``Tier.recover`` deletes Active-named leftovers after a crash. The task-private names carry the
task's start time, so two compactions of the same inputs at once (`quiverd compact` beside
the daemon's own pass) never share one: one replace wins, the other conflicts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
from ulid import ULID

from quiverd.kernel import fs
from quiverd.kernel.config import LakeConfig
from quiverd.kernel.durable import fsync_dir
from quiverd.kernel.errors import CatalogUnavailable, LakeError, LakeFileCorrupt
from quiverd.kernel.logs import Logger
from quiverd.lake.catalog import ReplaceConflict
from quiverd.lake.drift import conform, normalize, unify
from quiverd.lake.model import INGESTED_AT, REGISTERED, FileRow, FileState
from quiverd.lake.parquet import ActiveFile, FileFacts, ParquetSettings, crc32c_file, file_name
from quiverd.lake.partitions import key_partition, parse_object_key
from quiverd.lake.tier import Tier
from quiverd.lake.verified import read_verified

CANDIDATES_MAX = 100_000  # registered rows read per run
REPLACE_ATTEMPTS = 4  # catalog outages survived by one replace (it is idempotent)
REPLACE_RETRY_S = 0.5  # doubled per attempt
# What fails one task (and is reported in its result) rather than the whole run.
FAILURES = (LakeError, OSError, ValueError, pa.ArrowException)

Outcome = Literal["planned", "compacted", "conflict", "failed"]
GroupKey = tuple[str, int, int, str]  # (client, slot, shard, hour partition of the key)


class CompactionResult(msgspec.Struct, frozen=True, kw_only=True):
    """One output file (or, with dry_run, one planned task)."""

    outcome: Outcome
    client: str
    slot: int
    shard: int
    inputs: list[str]  # file ids, oldest first
    output: str = ""  # the new file id ("" when planned or failed before writing)
    rows: int = 0
    input_bytes: int = 0  # Parquet bytes of the inputs
    bytes: int = 0  # Parquet bytes of the output
    duration_ms: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class Task:
    key: GroupKey
    rows: list[FileRow]  # oldest first


async def compact(tier: Tier, *, client: str | None = None, dry_run: bool = False,
                  limiter: anyio.CapacityLimiter, log: Logger) -> list[CompactionResult]:
    """Merge this source's small registered files; one result per output (or plan)."""
    rows = await tier.catalog.list_files(client=client, states=REGISTERED,
                                         node_id=tier.node_id, source_id=tier.source_id,
                                         limit=CANDIDATES_MAX)
    tasks = plan(rows, tier.cfg.lake)
    if dry_run:
        return [_result("planned", t.key, t.rows) for t in tasks]
    results: list[CompactionResult] = []
    pending: Iterator[Task] = iter(tasks)

    async def worker() -> None:
        for task in pending:  # shared iterator: each task goes to one worker
            results.extend(await _run(tier, task, limiter, log))

    async with anyio.create_task_group() as tg:
        for _ in range(min(max(1, tier.cfg.lake.compaction.parallelism), len(tasks))):
            tg.start_soon(worker)
    return sorted(results, key=lambda r: (r.client, r.slot, r.shard, r.inputs))


def plan(rows: list[FileRow], lake: LakeConfig) -> list[Task]:
    """Tasks of >= 2 small files each, oldest first, within the per-task limits."""
    comp = lake.compaction
    groups: dict[GroupKey, list[FileRow]] = {}
    for row in rows:
        part = key_partition(row.object_key)
        if row.state in REGISTERED and row.compressed_size < comp.small_file_bytes and part:
            groups.setdefault((row.client_name, row.slot, row.shard, part), []).append(row)
    tasks: list[Task] = []
    for key, members in sorted(groups.items()):
        if len(members) < comp.min_files:
            continue
        members.sort(key=lambda r: (r.start_ts, r.first_segment, r.first_bundle, r.file_id))
        chunk: list[FileRow] = []
        for row in members:
            if chunk and (len(chunk) >= comp.max_files
                          or sum(r.uncompressed_size for r in chunk) + row.uncompressed_size
                          > comp.memory_limit_bytes
                          or sum(r.compressed_size for r in chunk) + row.compressed_size
                          > lake.file_size_bytes):
                if len(chunk) >= 2:
                    tasks.append(Task(key, chunk))
                chunk = []
            chunk.append(row)
        if len(chunk) >= 2:
            tasks.append(Task(key, chunk))
    return tasks


async def _run(tier: Tier, task: Task, limiter: anyio.CapacityLimiter, log: Logger
               ) -> list[CompactionResult]:
    """Fetch the inputs once, then write one output per run of unifiable schemas."""
    started = anyio.current_time()
    # Named after the input's id (the janitor keeps a staging file of a live id) and
    # stamped with this task's start, not the input's creation: a second compaction of
    # the same inputs at once (`quiverd compact` beside the daemon's pass) has paths of
    # its own, so neither deletes the other's inputs; one replace wins, one conflicts.
    stamp = time.time_ns()
    paths = [tier.data.staging_active / file_name(tier.node_id, stamp, r.file_id, "active")
             for r in task.rows]
    try:
        try:
            await _fetch(tier, task.rows, paths, limiter)
            runs = await anyio.to_thread.run_sync(_schema_runs, paths, limiter=limiter)
        except FAILURES as exc:
            return [_failed(task, exc, started, log)]
        results = []
        for lo, hi, schema in runs:
            if hi - lo < 2:
                continue  # a file alone is left as it is
            part = Task(task.key, task.rows[lo:hi])
            try:
                results.append(await _merge(tier, part, paths[lo:hi], schema, limiter, log))
            except FAILURES as exc:
                results.append(_failed(part, exc, started, log))
        return results
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_unlink_all, paths)


def _failed(task: Task, exc: Exception, started: float, log: Logger) -> CompactionResult:
    client, slot, shard, _ = task.key
    log.warning("lake_compaction_failed", client=client, slot=slot, shard=shard,
                inputs=[r.file_id for r in task.rows], error=str(exc),
                hint=getattr(exc, "hint", "") or None)
    return _result("failed", task.key, task.rows, error=f"{type(exc).__name__}: {exc}",
                   duration_ms=_ms_since(started))


async def _fetch(tier: Tier, rows: list[FileRow], paths: list[Path],
                 limiter: anyio.CapacityLimiter) -> None:
    """Each input into its task-private path: a hard link of the local copy, or a download."""
    sources = [Path(r.local_path) if r.local_path else None for r in rows]
    linked = await anyio.to_thread.run_sync(_link_all, sources, paths, limiter=limiter)
    for row, path, ok in zip(rows, paths, linked, strict=True):
        if not ok:
            await tier.store.get_file(row.object_key, path)
    # The whole input is read anyway: check it against the catalog's CRC-32C, so a
    # damaged object (or local copy) fails the task instead of going into the output.
    for row, path in zip(rows, paths, strict=True):
        crc = await anyio.to_thread.run_sync(crc32c_file, path, limiter=limiter)
        if row.crc32c and crc != row.crc32c:
            raise LakeFileCorrupt(f"lake file {row.file_id} ({row.uri}): CRC-32C {crc:08x}, "
                                  f"the catalog says {row.crc32c:08x}; not compacted")


async def _merge(tier: Tier, task: Task, paths: list[Path], schema: pa.Schema,
                 limiter: anyio.CapacityLimiter, log: Logger) -> CompactionResult:
    started = anyio.current_time()
    lake = tier.cfg.lake
    (client, slot, shard, _), rows = task.key, task.rows
    parsed = parse_object_key(rows[0].object_key)
    assert parsed is not None and parsed.partitioned, rows[0].object_key  # plan() checked
    new_id, now = str(ULID()), time.time_ns()
    active = tier.data.staging_active / file_name(tier.node_id, now, new_id, "active")
    stable = tier.data.staging_stable / file_name(tier.node_id, now, new_id, "stable")
    time_column = lake.time_column or INGESTED_AT
    if time_column not in schema.names:
        time_column = INGESTED_AT
    metadata = {"quiver.file_id": new_id, "quiver.client": client, "quiver.slot": str(slot),
                "quiver.node_id": tier.node_id, "quiver.source_id": tier.source_id,
                "quiver.shard": str(shard),
                "quiver.compacted_from": ",".join(r.file_id for r in rows)}
    settings = ParquetSettings(compression_level=lake.compression_level,
                               bloom_filter_columns=tuple(lake.index.bloom_filter_columns),
                               bloom_filter_fpp=lake.index.bloom_filter_fpp)
    received = FileRow(file_id=new_id, client_name=client, node_id=tier.node_id,
                       source_id=tier.source_id, shard=shard, slot=slot,
                       state=FileState.RECEIVED, local_path=str(active), created_at=now,
                       updated_at=now)
    await tier.catalog.insert_file(received)  # the janitor keeps what it names
    key = tier.object_key(client, slot, stable.name, parsed.hour)
    try:
        facts = await anyio.to_thread.run_sync(
            _write, paths, schema, active, stable, settings, metadata, time_column,
            lake.row_group_bytes, limiter=limiter)
        expected = sum(r.row_count for r in rows)
        if facts.rows != expected:
            raise LakeError(f"compacted file {new_id} holds {facts.rows} rows, its inputs "
                            f"{expected}: not registered")
        await tier.store.put_file(key, stable, size=facts.compressed_size, crc32c=facts.crc32c)
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_unlink_all, [active, stable])
            await _abandon(tier, received, key, f"compaction failed: {exc!r}")
        raise
    new_row = _new_row(tier, rows, facts, new_id=new_id, key=key, local=stable, now_ns=now)
    old_ids = [r.file_id for r in rows]
    try:
        await _replace(tier, old_ids, new_row)
    except ReplaceConflict as exc:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_unlink_all, [stable])
            await _abandon(tier, received, key, f"compaction conflict: {exc}")
        log.warning("lake_compaction_conflict", client=client, slot=slot, shard=shard,
                    inputs=old_ids, output=new_id, error=str(exc), hint=exc.hint)
        return _result("conflict", task.key, rows, output=new_id, error=str(exc),
                       duration_ms=_ms_since(started))
    result = _result("compacted", task.key, rows, output=new_id, out_bytes=facts.compressed_size,
                     duration_ms=_ms_since(started))
    log.info("lake_compacted", client=client, slot=slot, shard=shard, inputs=old_ids,
             file_id=new_id, rows=facts.rows, bytes=facts.compressed_size,
             input_bytes=result.input_bytes, uri=new_row.uri, duration_ms=result.duration_ms)
    return result


async def _abandon(tier: Tier, row: FileRow, key: str, reason: str) -> None:
    """The output's Received row -> Abandoned, its object (if written) deleted; a catalog
    or store still failing leaves them to the next start and the janitor."""
    try:
        await tier.abandon(msgspec.structs.replace(row, object_key=key, local_path=""),
                           reason=reason)
    except (CatalogUnavailable, LakeError, OSError) as exc:
        tier.log.warning("lake_compaction_output_left", file_id=row.file_id, key=key,
                         error=str(exc), hint="a start abandons it; the janitor deletes "
                         "its object after the grace")


async def _replace(tier: Tier, old_ids: list[str], new_row: FileRow) -> None:
    """catalog.replace, retried through short outages (a committed replace is a no-op)."""
    for attempt in range(REPLACE_ATTEMPTS):
        try:
            await tier.catalog.replace(old_ids, new_row)
            return
        except CatalogUnavailable:
            if attempt + 1 == REPLACE_ATTEMPTS:
                raise
            await anyio.sleep(REPLACE_RETRY_S * 2 ** attempt)


def _new_row(tier: Tier, rows: list[FileRow], facts: FileFacts, *, new_id: str, key: str,
             local: Path, now_ns: int) -> FileRow:
    first = min((r.first_segment, r.first_bundle) for r in rows)
    last = max((r.last_segment, r.last_bundle) for r in rows)
    head = rows[0]
    return FileRow(
        file_id=new_id, client_name=head.client_name, uri=tier.store.uri(key),
        start_ts=min(r.start_ts for r in rows), end_ts=max(r.end_ts for r in rows),
        row_count=facts.rows, uncompressed_size=facts.uncompressed_size,
        compressed_size=facts.compressed_size, schema_hash=facts.schema_hash,
        indexes=list(facts.indexes), uploaded_at=time.time_ns(), node_id=tier.node_id,
        source_id=head.source_id, shard=head.shard, slot=head.slot, object_key=key,
        first_segment=first[0], first_bundle=first[1], last_segment=last[0],
        last_bundle=last[1], bundle_count=sum(r.bundle_count for r in rows),
        crc32c=facts.crc32c, state=FileState.META_REGISTERED, local_path=str(local),
        created_at=now_ns, updated_at=now_ns)


def _result(outcome: Outcome, key: GroupKey, rows: list[FileRow], *, output: str = "",
            out_bytes: int = 0, duration_ms: float = 0.0, error: str = "") -> CompactionResult:
    return CompactionResult(
        outcome=outcome, client=key[0], slot=key[1], shard=key[2],
        inputs=[r.file_id for r in rows], output=output,
        rows=sum(r.row_count for r in rows),
        input_bytes=sum(r.compressed_size for r in rows), bytes=out_bytes,
        duration_ms=duration_ms, error=error)


def _ms_since(started: float) -> float:
    return round((anyio.current_time() - started) * 1000, 2)


# ---- worker-thread steps (blocking) -----------------------------------------------------

def _link_all(sources: list[Path | None], paths: list[Path]) -> list[bool]:
    """Hard-link each existing local copy to its task path; False where there is none."""
    seam = fs.active()
    seam.mkdir(paths[0].parent)
    out = []
    for src, dst in zip(sources, paths, strict=True):
        try:
            if src is None:
                raise FileNotFoundError
            seam.link(src, dst)
            out.append(True)
        except (FileNotFoundError, OSError):
            # Evicted (or another filesystem, or a link left by a crashed task): download.
            seam.unlink(dst, missing_ok=True)
            out.append(False)
    return out


def _schema_runs(paths: list[Path]) -> list[tuple[int, int, pa.Schema]]:
    """Consecutive inputs whose schemas unify: (first, end, representative schema)."""
    runs: list[tuple[int, int, pa.Schema]] = []
    start, current = 0, None
    for i, path in enumerate(paths):
        incoming = pq.read_schema(path)  # never an old-layout file (plan skips those)
        merged = unify(current, incoming)
        if merged is None:
            assert current is not None, "unify(None, s) always succeeds"
            runs.append((start, i, current))
            start, merged = i, normalize(incoming)
        current = merged
    if current is not None:
        runs.append((start, len(paths), current))
    return runs


def _write(paths: list[Path], schema: pa.Schema, active: Path, stable: Path,
           settings: ParquetSettings, metadata: dict[str, str], time_column: str,
           row_group_bytes: int) -> FileFacts:
    """Read, conform and append the inputs in order; close; rename Active -> Stable."""
    fs.active().mkdir(stable.parent)
    out = ActiveFile.create(active, schema, settings, metadata=metadata,
                            time_column=time_column)
    try:
        pending: list[pa.Table] = []
        held = 0
        for path in paths:
            table = conform(read_verified(path), schema)
            pending.append(table)
            held += table.nbytes
            if held >= row_group_bytes:
                out.append(pa.concat_tables(pending))
                pending, held = [], 0
        if pending:
            out.append(pa.concat_tables(pending))
        facts = out.close()
    except BaseException:
        out.abort()
        raise
    fs.active().rename(active, stable)
    fsync_dir(stable.parent)
    fsync_dir(active.parent)
    return facts


def _unlink_all(paths: list[Path]) -> None:
    seam = fs.active()
    for path in paths:
        seam.unlink(path, missing_ok=True)


__all__ = ["CompactionResult", "compact", "plan"]
