"""Bringing a quarantined lake file back, or giving it up: ``quiverd files restore`` and
``quiverd files forget`` (the commands every quarantine and missing-object hint names).

    restore FILE_ID [--from PATH]
        row Quarantined / Lost         row registered, object missing or damaged
            │                              │ (only with --from: put a copy back)
            ▼                              ▼
        --from PATH: the local copy's size and CRC-32C == the row's, else refused
                     (nothing uploaded); uploaded to the row's object key
                     (put_file: conditional create, verified after upload)
        the object at the row's key read back: size and CRC-32C == the row's, else
                     refused (the row stays as it was)
        catalog.restore: Quarantined / Lost -> Evicted, one transaction with
                     register's duplicate check; the Iceberg projection adds the
                     file back at its next reconcile (the daemon's timer,
                     lake.iceberg.reconcile_interval_s, or its next start)

    forget FILE_ID
        row Quarantined -> Lost: its rows are gone from the lake and that is now known:
        reported here once (event ``lake_file_lost``), then readers no longer fail on
        it, and ``fsck --lake`` lists it as KNOWN instead of LOST. The damaged copy stays
        under quarantine/ (quiverd never deletes there); a Lost file can still be
        restored.

Between the upload and the row's change, the janitor keeps the object: a key a
Quarantined or Lost row names is never an orphan (lake.janitor). Both commands are
idempotent: run again after a failure, they finish the job or say it is done.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec

from quiverd.kernel.errors import ConfigError, LakeFileCorrupt, LakeFileMissing, ObjectExists
from quiverd.lake.catalog import StateConflict
from quiverd.lake.model import REGISTERED, RESTORABLE, FileRow
from quiverd.lake.parquet import crc32c_file
from quiverd.lake.scrub import QUARANTINE_PREFIX, check_object
from quiverd.lake.tier import Tier


class Restored(msgspec.Struct, kw_only=True):
    file_id: str
    uri: str
    rows: int
    state: str  # the row's state afterwards
    source: str  # the local copy uploaded, or "store" (the object already at its key)
    changed: bool  # False: the file already was registered with a sound object


async def restore_file(tier: Tier, file_id: str, source: Path | None = None) -> Restored:
    """Check a copy of the file against its row and make it live again (module doc).
    Raises ConfigError (unknown id), StateConflict (a state with nothing to restore),
    LakeFileCorrupt (a copy that is not the file), LakeFileMissing (no object, no --from)."""
    row = await tier.catalog.get(file_id)
    if row is None:
        raise ConfigError("file_id", f"no lake file {file_id!r} in the catalog",
                          hint="`quiverd files list --state Quarantined` lists the "
                          "quarantined files")
    if row.state not in RESTORABLE and row.state not in REGISTERED:
        raise StateConflict(f"lake file {file_id} is {row.state.value}: only a quarantined, "
                            "lost or registered file can be restored",
                            hint="`quiverd files show FILE_ID` shows its row")
    uploaded = source is not None and await _upload(tier, row, source)
    try:
        reason = await check_object(tier, row)
    except FileNotFoundError:
        raise LakeFileMissing(
            f"lake file {file_id}: the store has no object at {row.uri}",
            hint="put the backup there first, or pass it with `--from PATH` (uploaded to "
            "that key after its size and CRC-32C are checked)") from None
    if reason is not None:
        raise LakeFileCorrupt(
            f"lake file {file_id}: the object at {row.uri} is not this file: {reason}; "
            f"the row stays {row.state.value}",
            hint="put a copy with the catalog's size and CRC-32C at that key (or pass it "
            "with --from PATH after deleting the object there); `quiverd files show "
            "FILE_ID` shows both")
    changed = row.state in RESTORABLE and await tier.catalog.restore(file_id)
    if changed:
        tier.log.warning("lake_file_restored", file_id=file_id, client=row.client_name,
                         slot=row.slot, uri=row.uri, rows=row.row_count,
                         source=str(source) if source else "store", was=row.state.value)
    after = await tier.catalog.get(file_id)
    return Restored(file_id=file_id, uri=row.uri, rows=row.row_count,
                    state=(after or row).state.value, changed=changed or uploaded,
                    source=str(source) if source else "store")


async def _upload(tier: Tier, row: FileRow, source: Path) -> bool:
    """The local copy, checked against the row first (a wrong copy is never uploaded);
    False when the key already held this very file (nothing to upload)."""
    def facts() -> tuple[int, int]:
        return source.stat().st_size, crc32c_file(source)

    size, crc = await anyio.to_thread.run_sync(facts)
    if (size, crc) != (row.compressed_size, row.crc32c):
        raise LakeFileCorrupt(
            f"{source} is not lake file {row.file_id}: {size} bytes with CRC-32C {crc:08x}, "
            f"the catalog says {row.compressed_size} bytes with {row.crc32c:08x}; nothing "
            "was uploaded", hint="pass the backup of this file id (its name holds the id)")
    present = await tier.store.stat(row.object_key) is not None
    try:
        await tier.store.put_file(row.object_key, source, size=size, crc32c=crc)
        return not present  # put_file returns for an identical object already there
    except ObjectExists:
        raise LakeFileCorrupt(
            f"lake file {row.file_id}: the store already holds another object at {row.uri} "
            "(not this file's size and CRC-32C); nothing was uploaded",
            hint="an object is never overwritten: move that one away (or delete it) and "
            "run the command again") from None


async def forget_file(tier: Tier, file_id: str) -> tuple[FileRow, bool]:
    """Quarantined -> Lost, reported once (module doc); (the row, whether this call
    moved it: False when it already was Lost)."""
    row = await tier.catalog.get(file_id)
    if row is None:
        raise ConfigError("file_id", f"no lake file {file_id!r} in the catalog",
                          hint="`quiverd files list --state Quarantined` lists the "
                          "quarantined files")
    moved = await tier.catalog.forget(file_id)
    if moved:
        tier.log.error("lake_file_lost", file_id=file_id, client=row.client_name,
                       slot=row.slot, rows=row.row_count, bundles=bundle_range(row),
                       quarantined_at=tier.store.uri(QUARANTINE_PREFIX + row.object_key),
                       hint="recorded as lost: reads no longer fail on it; `quiverd files "
                       "restore FILE_ID --from PATH` still brings it back")
    return (await tier.catalog.get(file_id) or row), moved


def bundle_range(row: FileRow) -> str:
    return (f"({row.shard}, {row.first_segment}, {row.first_bundle})..({row.shard}, "
            f"{row.last_segment}, {row.last_bundle})")


__all__ = ["Restored", "bundle_range", "forget_file", "restore_file"]
