"""One Iceberg snapshot of the projection: files added and deleted, properties set, in
one transaction (``commit_once``), and the table properties the projection keeps.

    commit_once(table, footers, deleted DataFiles, summary, properties)
      │ name mapping set on first use (the files carry no Iceberg field ids)
      │ each footer: its hour partition, its schema against the table's (cached verdicts);
      │   new columns / wider ints and floats: the schema evolves in the same transaction
      │ merge append (nothing deleted) | overwrite (delete + add)
      └ summary: quiverd.file-ids, quiverd.removed-file-ids, the caller's keys

Table properties (per source id): ``quiverd.commits.<source>`` counts the source's
commits (``Projection.sync``'s fence); ``quiverd.skipped-files|rows|file-ids.<source>``
name its registered files the table cannot hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from quiverd.lake.iceberg import catalog as cat
from quiverd.lake.iceberg.files import Footer, fits_table, nullable, partition_of, to_data_file

FILE_IDS = "quiverd.file-ids"
REMOVED_FILE_IDS = "quiverd.removed-file-ids"
KIND = "quiverd.kind"
COMMITS_PREFIX = "quiverd.commits."  # + source id: that source's commits (sync's fence)
# + source id: that source's registered files the table cannot hold, and their rows
SKIPPED_FILES = "quiverd.skipped-files."
SKIPPED_ROWS = "quiverd.skipped-rows."
SKIPPED_IDS = "quiverd.skipped-file-ids."
SKIPPED_IDS_LISTED = 100  # ids named in the property (the counts are complete)
FITS_CACHE = 1024  # schema verdicts kept (cleared when full)


def skip_properties(source: str, rows: Mapping[str, int]) -> dict[str, tuple[str, str]]:
    """The table properties naming ``source``'s files the table cannot hold: key ->
    (value, the value an absent key stands for)."""
    ids = sorted(rows)
    listed = ",".join(ids[:SKIPPED_IDS_LISTED]) + (",..." if len(ids) > SKIPPED_IDS_LISTED else "")
    return {SKIPPED_FILES + source: (str(len(ids)), "0"),
            SKIPPED_ROWS + source: (str(sum(rows.values())), "0"),
            SKIPPED_IDS + source: (listed, "")}


def commits_of(tbl: Any | None, key: str) -> int:
    """The commit count a table's property ``key`` holds (0 when absent or no table)."""
    if tbl is None:
        return 0
    try:
        return int(tbl.metadata.properties.get(key, "0"))
    except ValueError:
        return -1  # not ours to read: never equal to a caller's count, so fenced



def commit_once(tbl: Any, footers: list[Footer], deleted: list[Any], summary: dict[str, str],
                 fits: dict[tuple[str, int, pa.Schema], bool], *,
                 properties: dict[str, Any] | None = None, force: bool = False
                 ) -> tuple[int | None, list[str], list[str], list[tuple[str, str]]]:
    """One attempt: (snapshot id, file ids added, locations removed, files refused).
    ``deleted``: DataFiles of the current snapshot to delete; ``properties``: table
    properties set in the same commit, when a snapshot is made or, with ``force``, alone.

    ``tbl.metadata`` is read directly where it suffices: every read of a transaction's
    ``table_metadata`` deep-copies the whole metadata (every kept snapshot), which would
    make a commit's cost grow with history. The transaction's view is taken once, and
    only when a file's schema needs evolving."""
    from pyiceberg.exceptions import ValidationError
    from pyiceberg.table import TableProperties

    if tbl is None:  # nothing to add, no table: nothing to remove either
        return None, [], [], []
    from quiverd.lake.iceberg.memo import transaction

    base = tbl.metadata
    tx = transaction(tbl)
    changed = base.name_mapping() is None
    if changed:
        # The files carry no Iceberg field ids: readers map columns by name.
        tx.set_properties(**{TableProperties.DEFAULT_NAME_MAPPING:
                             base.schema().name_mapping.model_dump_json()})
    source = cat.partition_source(base)
    ready, unfit = [], []
    for footer in footers:
        ref = footer.ref
        hour, problem = partition_of(footer, source) if source is not None else (None, None)
        if problem is not None:
            unfit.append((ref.file_id, problem))
            continue
        key = (str(base.table_uuid), base.current_schema_id, footer.schema)
        if key not in fits:
            if len(fits) >= FITS_CACHE:
                fits.clear()
            fits[key] = fits_table(base, footer.schema)
        if not fits[key]:
            try:  # new columns, or a wider int or float: evolve the table first
                with tx.update_schema() as update:
                    update.union_by_name(nullable(footer.schema))
            except (ValidationError, ValueError) as exc:
                unfit.append((ref.file_id, f"a column type Iceberg cannot evolve to: {exc}"))
                continue
            changed = True
        ready.append((footer, hour, fits[key]))
    meta = tx.table_metadata if changed else base
    data_files, added = [], []
    for footer, hour, checked in ready:
        try:
            data_files.append(to_data_file(footer, meta, hour,
                                           checked=checked and meta is base))
        except ValueError as exc:
            unfit.append((footer.ref.file_id, "the file's schema does not fit the table's: "
                          + str(exc).split("\n", 1)[0]))
            continue
        added.append(footer.ref.file_id)
    if not data_files and not deleted:
        if force and properties:
            tx.set_properties(properties)
            tx.commit_transaction()
        return None, [], [], unfit
    if properties:
        tx.set_properties(properties)
    props = {**summary, FILE_IDS: ",".join(added),
             REMOVED_FILE_IDS: ",".join(cat.file_id_of(d.file_path) for d in deleted)}
    snapshot = tx.update_snapshot(snapshot_properties=props)
    # merge_append is pyiceberg's append that honours commit.manifest-merge.enabled (a fast
    # append never merges); an overwrite rewrites only the manifests holding removed files.
    producer = snapshot.overwrite() if deleted else snapshot.merge_append()
    with producer:
        for data_file in deleted:
            producer.delete_data_file(data_file)
        for data_file in data_files:
            producer.append_data_file(data_file)
    committed = tx.commit_transaction()
    return committed.metadata.current_snapshot_id, added, [d.file_path for d in deleted], unfit
