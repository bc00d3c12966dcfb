"""The lake scrub: every registered object of this node read back through the store at
a bounded rate and checked against its catalog row; a damaged one is quarantined.

    catalog rows of this node in REGISTERED states, by file id (a ULID: oldest first,
    new files last), after ``after`` when a pass cut short by a restart resumes
        │  stat (size), then ranged reads of ``chunk`` bytes paced to ``rate_bytes_per_s``
        ▼  whole-object CRC-32C
    size and CRC-32C as the row says ──▶ nothing (checked_files, checked_bytes)
    object absent ─────────────────────▶ counted as missing; the janitor reports it
                                         (lake_row_missing_object), fsck --lake lists it
    size or CRC-32C differs ───────────▶ quarantine, in this order:
        1. copy the object to ``quarantine/<object_key>`` in the same store (quiverd
           never deletes there: the janitor only touches ``client=…`` keys)
        2. the catalog row Registered -> Quarantined (only from a REGISTERED state, so
           a compaction that replaced the file meanwhile wins and nothing changes)
        3. delete the original key
        event ``lake_object_corrupt`` (error), ``quiver_lake_objects_corrupt_total``

Why quarantine instead of keeping the file readable: its pages fail their checksums
(the reader would fail on it anyway) and its values cannot be trusted. Readers skip
nothing silently: a read whose selection holds a Quarantined file fails naming it,
unless the reader opts out (``skip_quarantined``). The file's rows are gone from the
lake: the event names its bundle range and which of its segments this data directory
still holds (a copy of the rows, until retention deletes them).

A crash between the steps is safe: before 2, the next pass finds the same damage and
copies again; after 2, each pass starts by finishing it (``finish_quarantines``: a
Quarantined row's key that still holds an object that is not the file is copied to
quarantine/ if not there yet, then deleted). The janitor never deletes a key a
Quarantined row names: it is where ``quiverd files restore`` puts the file back, so a
sound object there is kept.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import msgspec

from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import LakeError
from quiverd.kernel.layout import segment_path
from quiverd.lake.model import REGISTERED, FileRow, FileState
from quiverd.lake.tier import Tier

QUARANTINE_PREFIX = "quarantine/"
MAX_CHUNK_BYTES = 8 * 1024 * 1024  # one ranged read
MIN_CHUNK_BYTES = 64 * 1024
CHUNKS_PER_S = 8  # at low rates, smaller reads keep the pace smooth
LIST_LIMIT = 200_000  # rows one pass checks; the rest wait for the next pass
SEGMENTS_SHOWN = 32  # held segments named in one event
PROGRESS_EVERY_S = 10.0  # how often a pass reports how far it got (a restart resumes there)


class Corrupt(msgspec.Struct, kw_only=True):
    file_id: str
    uri: str
    reason: str
    quarantined_to: str = ""  # the quarantine URI; "" when not quarantined (dry run)


class ScrubReport(msgspec.Struct, kw_only=True):
    """What one pass found; with ``quarantine=False`` nothing was changed."""

    files_checked: int = 0
    bytes_checked: int = 0
    corrupt: list[Corrupt] = msgspec.field(default_factory=list)
    missing: list[str] = msgspec.field(default_factory=list)  # file ids without an object
    failures: list[str] = msgspec.field(default_factory=list)  # "<what>: <error>"
    duration_ms: float = 0.0


async def scrub_pass(tier: Tier, *, rate_bytes_per_s: float, quarantine: bool = True,
                     on_corrupt: Callable[[Corrupt], Awaitable[None]] | None = None,
                     after: str = "",
                     progress: Callable[[str], Awaitable[None]] | None = None,
                     ) -> ScrubReport:
    """Check every registered object of this node once (module doc), or those whose file
    id sorts after ``after``; ``progress(file_id)`` is awaited at most every
    ``PROGRESS_EVERY_S`` with the last file id done (the janitor records it, so a pass
    cut short by a restart resumes there instead of starting over)."""
    started = anyio.current_time()
    report = ScrubReport()
    await finish_quarantines(tier, report)
    listed = await tier.catalog.list_files(node_id=tier.node_id, states=REGISTERED,
                                           limit=LIST_LIMIT)
    rows = sorted((r for r in listed if r.file_id > after), key=lambda r: r.file_id)
    noted = anyio.current_time()
    chunk = int(min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, rate_bytes_per_s / CHUNKS_PER_S)))
    tier.log.info("lake_scrub_pass_started", files=len(rows),
                  bytes=sum(r.compressed_size for r in rows),
                  rate_bytes_per_s=int(rate_bytes_per_s))
    done = after  # the last file id this pass is through with
    for row in rows:
        if progress is not None and done and anyio.current_time() - noted >= PROGRESS_EVERY_S:
            await progress(done)
            noted = anyio.current_time()
        done = row.file_id  # a resumed pass re-reads a file its restart cut into
        if not row.object_key:
            continue
        try:
            reason = await check_object(tier, row, rate_bytes_per_s=rate_bytes_per_s,
                                        chunk_bytes=chunk)
        except FileNotFoundError:
            # Replaced by a compaction since the listing (and its object deleted) is not
            # missing: only a row still registered is.
            now = await tier.catalog.get(row.file_id)
            if now is not None and now.state in REGISTERED:
                report.missing.append(row.file_id)
            continue
        except LakeError as exc:
            report.failures.append(f"check {row.file_id}: {exc}")
            continue
        report.files_checked += 1
        report.bytes_checked += row.compressed_size
        if reason is None:
            continue
        found = Corrupt(file_id=row.file_id, uri=row.uri, reason=reason)
        if quarantine:
            try:
                found.quarantined_to = await quarantine_file(tier, row, reason)
            except (LakeError, FileNotFoundError) as exc:
                report.failures.append(f"quarantine {row.file_id}: {exc}")
        report.corrupt.append(found)
        if on_corrupt is not None:
            await on_corrupt(found)
    report.duration_ms = round((anyio.current_time() - started) * 1000, 2)
    tier.log.info("lake_scrub_pass_finished", files=report.files_checked,
                  bytes=report.bytes_checked, corrupt=len(report.corrupt),
                  missing=len(report.missing), failures=len(report.failures),
                  duration_ms=report.duration_ms)
    return report


async def check_object(tier: Tier, row: FileRow, *, rate_bytes_per_s: float = 0,
                       chunk_bytes: int = MAX_CHUNK_BYTES) -> str | None:
    """None when the object has the row's size and CRC-32C, else what differs.
    FileNotFoundError when it is absent. ``rate_bytes_per_s`` 0: as fast as it reads."""
    info = await tier.store.stat(row.object_key)
    if info is None:
        raise FileNotFoundError(row.uri)
    if info.size != row.compressed_size:
        return f"{info.size} bytes in the store, the catalog says {row.compressed_size}"
    crc, offset = 0, 0
    started = anyio.current_time()
    while offset < info.size:
        data = await tier.store.read_range(row.object_key, offset,
                                           min(chunk_bytes, info.size - offset))
        if not data:
            return f"the object ends at {offset} bytes, the catalog says {info.size}"
        crc = crc32c(data, crc)  # releases the GIL for large buffers (kernel.crc)
        offset += len(data)
        if rate_bytes_per_s > 0:
            await anyio.sleep(max(0.0, started + offset / rate_bytes_per_s
                                  - anyio.current_time()))
    if crc != row.crc32c:
        return f"CRC-32C {crc:08x}, the catalog says {row.crc32c:08x}"
    return None


async def quarantine_file(tier: Tier, row: FileRow, reason: str) -> str:
    """Copy, mark Quarantined, delete the original (module doc); the quarantine URI, or
    "" when the row left the registered states meanwhile (nothing then changes)."""
    target = QUARANTINE_PREFIX + row.object_key
    await tier.store.copy(row.object_key, target)
    moved = await tier.catalog.set_state_if(row.file_id, FileState.QUARANTINED, REGISTERED,
                                            local_path="")
    if not moved:
        await tier.store.delete(target)
        return ""
    await tier.store.delete(row.object_key)
    held = await anyio.to_thread.run_sync(segments_held, tier, row)
    tier.log.error(
        "lake_object_corrupt", file_id=row.file_id, client=row.client_name, slot=row.slot,
        shard=row.shard, uri=row.uri, reason=reason, quarantined_to=tier.store.uri(target),
        rows=row.row_count,
        bundles=f"({row.shard}, {row.first_segment}, {row.first_bundle})..({row.shard}, "
        f"{row.last_segment}, {row.last_bundle})",
        segments_still_held=held[:SEGMENTS_SHOWN],
        hint="its rows are no longer in the lake: reads naming it fail until it is restored "
        f"(or read with skip_quarantined); `quiverd files restore {row.file_id} --from PATH` "
        "puts a backup back (checked against the catalog's size and CRC-32C), "
        + ("or copy the rows out of the segments listed, which still hold them until "
           "retention deletes them," if held else
           "or re-ingest them (no segment of this data directory holds them any more)")
        + f" and `quiverd files forget {row.file_id}` records the file as lost")
    return tier.store.uri(target)


async def finish_quarantines(tier: Tier, report: ScrubReport) -> None:
    """Quarantines a crash cut after the row changed: the damaged object still at its
    key is moved out of the readers' way (module doc). A sound object there is a copy
    put back for ``quiverd files restore``: kept."""
    rows = await tier.catalog.list_files(node_id=tier.node_id,
                                         states=[FileState.QUARANTINED], limit=LIST_LIMIT)
    for row in rows:
        if not row.object_key:
            continue
        try:
            if await check_object(tier, row) is None:
                continue
            target = QUARANTINE_PREFIX + row.object_key
            if await tier.store.stat(target) is None:
                await tier.store.copy(row.object_key, target)
            await tier.store.delete(row.object_key)
        except FileNotFoundError:
            continue  # the usual case: the quarantine moved it out
        except LakeError as exc:
            report.failures.append(f"finish quarantine {row.file_id}: {exc}")
            continue
        tier.log.warning("lake_quarantine_finished", file_id=row.file_id, uri=row.uri,
                         quarantined_to=tier.store.uri(target))


def segments_held(tier: Tier, row: FileRow) -> list[int]:
    """The file's segments this data directory still has (a copy of its rows)."""
    if row.source_id != tier.source_id:
        return []
    segments = tier.data.shard(row.shard).segments_dir
    last = min(row.last_segment, row.first_segment + SEGMENTS_SHOWN - 1)
    return [seq for seq in range(row.first_segment, last + 1)
            if segment_path(segments, seq).exists()]


__all__ = ["QUARANTINE_PREFIX", "Corrupt", "ScrubReport", "check_object", "finish_quarantines",
           "quarantine_file", "scrub_pass"]
