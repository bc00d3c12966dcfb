"""The catalog's SQL, shared by both backends (``sqlite``, ``pg``).

Statements use "?" placeholders; PostgreSQL's get numbered (``numbered``). The table
layout is drawn in ``quiverd.lake.catalog``; migrations are ordered steps, never edited
once released.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from quiverd.lake.catalog.base import ReplaceConflict, StateConflict
from quiverd.lake.model import (
    REGISTERED,
    RESTORABLE,
    UNFINISHED,
    Coverage,
    FileRow,
    FileState,
    ZoneMap,
    decode_indexes,
    encode_indexes,
)
from quiverd.lake.partitions import key_partition, same_partition

CHUNK_IDS = 500  # ids per IN (...) list: SQLite allows 32766 parameters, PostgreSQL 65535


# ---- schema ---------------------------------------------------------------------------
# SQL shared by both backends uses "?" placeholders; PostgreSQL's get numbered (`numbered`).
# "{json}" and "{id}" are the two spots where the dialects differ.

FILE_COLUMNS: tuple[str, ...] = tuple(FileRow.__struct_fields__)
_FILE_COLUMN_TYPES: dict[str, str] = {
    "file_id": "{id} NOT NULL PRIMARY KEY", "client_name": "TEXT NOT NULL",
    "uri": "TEXT NOT NULL", "start_ts": "BIGINT NOT NULL", "end_ts": "BIGINT NOT NULL",
    "row_count": "BIGINT NOT NULL", "uncompressed_size": "BIGINT NOT NULL",
    "compressed_size": "BIGINT NOT NULL", "schema_hash": "TEXT NOT NULL",
    "indexes": "{json} NOT NULL", "uploaded_at": "BIGINT NOT NULL", "node_id": "TEXT NOT NULL",
    "source_id": "TEXT NOT NULL", "shard": "BIGINT NOT NULL", "slot": "BIGINT NOT NULL",
    "object_key": "TEXT NOT NULL", "first_segment": "BIGINT NOT NULL",
    "first_bundle": "BIGINT NOT NULL", "last_segment": "BIGINT NOT NULL",
    "last_bundle": "BIGINT NOT NULL", "bundle_count": "BIGINT NOT NULL",
    "crc32c": "BIGINT NOT NULL", "state": "TEXT NOT NULL", "local_path": "TEXT NOT NULL",
    "compacted_into": "TEXT NOT NULL", "created_at": "BIGINT NOT NULL",
    "updated_at": "BIGINT NOT NULL",
}
assert tuple(_FILE_COLUMN_TYPES) == FILE_COLUMNS, "files columns must follow FileRow"

SCHEMA_VERSION_DDL = ("CREATE TABLE IF NOT EXISTS schema_version "
                      "(version BIGINT NOT NULL PRIMARY KEY, applied_at BIGINT NOT NULL)")

# Ordered steps; step N is applied in one transaction with its schema_version row. Never
# edit a released step: append a new one.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        "CREATE TABLE files (" + ", ".join(f"{c} {t}" for c, t in _FILE_COLUMN_TYPES.items())
        + ")",
        "CREATE INDEX files_client_start ON files (client_name, start_ts)",
        "CREATE INDEX files_source_shard ON files (source_id, shard)",
        "CREATE INDEX files_state ON files (state)",
        "CREATE TABLE coverage (file_id {id} NOT NULL REFERENCES files (file_id), "
        "source_id TEXT NOT NULL, shard BIGINT NOT NULL, slot BIGINT NOT NULL, "
        "segment_seq BIGINT NOT NULL, bundle_indexes TEXT NOT NULL, "
        "PRIMARY KEY (file_id, segment_seq))",
        "CREATE INDEX coverage_segment ON coverage (source_id, shard, segment_seq)",
        "CREATE TABLE zone_maps (file_id {id} NOT NULL REFERENCES files (file_id), "
        "column_name TEXT NOT NULL, min_value TEXT NOT NULL, max_value TEXT NOT NULL, "
        "null_count BIGINT NOT NULL, PRIMARY KEY (file_id, column_name))",
    ),
)


def migration_sql(step: tuple[str, ...], *, json_type: str, id_type: str) -> list[str]:
    return [s.replace("{json}", json_type).replace("{id}", id_type) for s in step]


def _in_states(states: Iterable[FileState]) -> str:
    # Enum constants, never user input: inlined so no placeholder counting is needed.
    return "(" + ", ".join(f"'{s.value}'" for s in sorted(states)) + ")"


def in_list(n: int) -> str:
    return "(" + ", ".join("?" * n) + ")"


REGISTERED_SQL = _in_states(REGISTERED)
_COLS = ", ".join(FILE_COLUMNS)
SELECT_FILES = f"SELECT {_COLS} FROM files"
INSERT_FILE = (f"INSERT INTO files ({_COLS}) VALUES {in_list(len(FILE_COLUMNS))} "
               "ON CONFLICT (file_id) DO NOTHING")
# Registration's upsert: only an unfinished row may be overwritten (created_at is kept).
UPSERT_REGISTERED = (
    f"INSERT INTO files ({_COLS}) VALUES {in_list(len(FILE_COLUMNS))} "
    "ON CONFLICT (file_id) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in FILE_COLUMNS if c not in ("file_id", "created_at"))
    + f" WHERE files.state IN {_in_states(UNFINISHED)}"
)
INSERT_COVERAGE = ("INSERT INTO coverage (file_id, source_id, shard, slot, segment_seq, "
                   "bundle_indexes) VALUES (?, ?, ?, ?, ?, ?)")
# Coverage of other registered files in the segment range of a new file (same slot).
OVERLAP_CANDIDATES = (
    "SELECT c.file_id, c.segment_seq, c.bundle_indexes, f.object_key FROM coverage c "
    "JOIN files f ON f.file_id = c.file_id "
    "WHERE c.source_id = ? AND c.shard = ? AND c.slot = ? AND c.segment_seq BETWEEN ? AND ? "
    f"AND c.file_id <> ? AND f.state IN {REGISTERED_SQL}"
)
COVERED = ("SELECT c.slot, c.bundle_indexes, f.object_key FROM coverage c "
           "JOIN files f ON f.file_id = c.file_id "
           "WHERE c.source_id = ? AND c.shard = ? AND c.segment_seq = ? "
           f"AND f.state IN {REGISTERED_SQL}")
FILE_STATE = "SELECT state FROM files WHERE file_id = ?"
FILE_COVERAGE = "SELECT segment_seq, bundle_indexes FROM coverage WHERE file_id = ?"
INSERT_ZONE_MAP = ("INSERT INTO zone_maps (file_id, column_name, min_value, max_value, "
                   "null_count) VALUES (?, ?, ?, ?, ?)")
DELETABLE_SQL = _in_states({FileState.ABANDONED, FileState.COMPACTED})


def numbered(sql: str) -> str:
    """The shared SQL for PostgreSQL: each "?" becomes $1, $2, … (it has no other "?")."""
    parts = sql.split("?")
    return parts[0] + "".join(f"${i}{part}" for i, part in enumerate(parts[1:], 1))


def chunks(ids: Sequence[str]) -> list[list[str]]:
    unique = list(dict.fromkeys(ids))
    return [unique[i:i + CHUNK_IDS] for i in range(0, len(unique), CHUNK_IDS)]


# ---- rows <-> values --------------------------------------------------------------------

def row_values(row: FileRow, *, state: FileState, now_ns: int) -> tuple[Any, ...]:
    """``row`` as ``files`` column values (type-checked: SQLite would store anything)."""
    checked = msgspec.convert(msgspec.to_builtins(row), FileRow)
    checked.state = state
    checked.created_at = checked.created_at or now_ns
    checked.updated_at = now_ns
    return tuple(_to_column(c, getattr(checked, c)) for c in FILE_COLUMNS)


def row_from_record(rec: Mapping[str, Any]) -> FileRow:
    values = {c: rec[c] for c in FILE_COLUMNS}
    values["indexes"] = msgspec.json.decode(values["indexes"])
    values["state"] = FileState(values["state"])
    return FileRow(**values)


_SETTABLE = frozenset(FILE_COLUMNS) - {"file_id", "state", "updated_at"}


def settable_fields(file_id: str, fields: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(column, value) pairs for set_state, type-checked against FileRow."""
    unknown = sorted(set(fields) - _SETTABLE)
    if unknown:
        raise ValueError(f"set_state cannot set {unknown}: settable are {sorted(_SETTABLE)}")
    checked = msgspec.convert({"file_id": file_id, "client_name": "", **fields}, FileRow)
    return [(name, _to_column(name, getattr(checked, name))) for name in fields]


def _to_column(name: str, value: Any) -> Any:
    if name == "indexes":
        return msgspec.json.encode(value).decode()
    if name == "state":
        return FileState(value).value
    return value


def check_coverage(coverage: Sequence[Coverage]) -> None:
    seqs = [c.segment_seq for c in coverage]
    if not seqs:
        raise ValueError("a registered file covers at least one bundle")
    if len(set(seqs)) != len(seqs):
        raise ValueError(f"coverage names a segment twice: {sorted(seqs)}")
    for c in coverage:
        idx = c.bundle_indexes
        if not idx or idx[0] < 0 or any(b <= a for a, b in zip(idx, idx[1:], strict=False)):
            raise ValueError(f"segment {c.segment_seq}: bundle indexes must be sorted, "
                             f"distinct, non-negative and not empty: {idx}")


def coverage_values(row: FileRow, coverage: Sequence[Coverage]) -> list[tuple[Any, ...]]:
    return [(row.file_id, row.source_id, row.shard, row.slot, c.segment_seq,
             encode_indexes(c.bundle_indexes)) for c in coverage]


def overlap_args(row: FileRow, coverage: Sequence[Coverage]) -> tuple[Any, ...]:
    seqs = [c.segment_seq for c in coverage]
    return (row.source_id, row.shard, row.slot, min(seqs), max(seqs), row.file_id)


def overlapping_files(coverage: Sequence[Coverage], candidates: Iterable[Mapping[str, Any]],
                      object_key: str = "") -> list[str]:
    """Other files (OVERLAP_CANDIDATES rows) holding any bundle of ``coverage`` in the
    same hour partition as ``object_key``: the uploader splits a bundle's slot that spans
    hours into one file per hour (``lake.partitions``), each covering the bundle for its
    hour; a key of the layout before hours covers the whole slot."""
    mine = {c.segment_seq: set(c.bundle_indexes) for c in coverage}
    part = key_partition(object_key)
    return sorted({rec["file_id"] for rec in candidates
                   if mine.get(rec["segment_seq"], set()) & set(decode_indexes(
                       rec["bundle_indexes"]))
                   and same_partition(part, key_partition(rec["object_key"] or ""))})


def covered_parts(records: Iterable[Mapping[str, Any]]) -> dict[tuple[int, str], set[int]]:
    """COVERED rows as (slot, hour partition of the file: "" for a whole slot) -> bundles."""
    out: dict[tuple[int, str], set[int]] = {}
    for r in records:
        part = (r["slot"], key_partition(r["object_key"] or ""))
        out.setdefault(part, set()).update(decode_indexes(r["bundle_indexes"]))
    return out


def coverage_equal(coverage: Sequence[Coverage], recs: Iterable[Mapping[str, Any]]) -> bool:
    stored = {r["segment_seq"]: decode_indexes(r["bundle_indexes"]) for r in recs}
    return stored == {c.segment_seq: tuple(c.bundle_indexes) for c in coverage}


def check_repeat(row: FileRow, state: str, coverage: Sequence[Coverage],
                 stored: Iterable[Mapping[str, Any]]) -> None:
    """A repeated register must name the coverage the file was registered with."""
    if FileState(state) in REGISTERED and not coverage_equal(coverage, stored):
        raise ValueError(f"{row.file_id} is registered with other coverage: a file id names "
                         "one file's content")


def needs_registration(file_id: str, state: str | None) -> bool:
    """Whether register must write the row, given its current state (None: no row)."""
    if state is None or FileState(state) in UNFINISHED:
        return True
    if FileState(state) is FileState.ABANDONED:
        raise StateConflict(f"{file_id} is Abandoned: its object is deleted, it cannot be "
                            "registered", hint="upload the bundles again under a new file id")
    return False


def restore_needed(file_id: str, state: str | None) -> bool:
    """Whether restore must move the row, given its state (None: no row)."""
    if state is None:
        raise KeyError(file_id)
    if FileState(state) in REGISTERED:
        return False
    if FileState(state) not in RESTORABLE:
        raise StateConflict(f"{file_id} is {state}: only a quarantined or lost file can be "
                            "restored", hint="`quiverd files show FILE_ID` shows its state")
    return True


def restore_args(row: FileRow, recs: Iterable[Mapping[str, Any]]
                 ) -> tuple[list[Coverage], tuple[Any, ...] | None]:
    """The file's stored coverage (FILE_COVERAGE rows) and OVERLAP_CANDIDATES' arguments
    for it (None when it holds no coverage: nothing to check)."""
    coverage = [Coverage(segment_seq=r["segment_seq"],
                         bundle_indexes=decode_indexes(r["bundle_indexes"])) for r in recs]
    return coverage, (overlap_args(row, coverage) if coverage else None)


# A restored file is Evicted: its object is authoritative, it has no local copy (the
# quarantine cleared it), and its zone maps, if it had some, are still recorded.
RESTORE_ROW = (f"UPDATE files SET state = '{FileState.EVICTED.value}', local_path = '', "
               f"updated_at = ? WHERE file_id = ? AND state IN {_in_states(RESTORABLE)}")


def replace_is_done(old_ids: Sequence[str], new_id: str,
                    recs: Iterable[Mapping[str, Any]]) -> bool:
    """Check a replace's inputs (rows of file_id, state, compacted_into): True when it
    already committed (a retry), False when it may run; ReplaceConflict otherwise."""
    if not old_ids or new_id in old_ids:
        raise ValueError(f"replace needs old ids, without the new one: {old_ids} -> {new_id}")
    found = {r["file_id"]: (FileState(r["state"]), r["compacted_into"]) for r in recs}
    if all(found.get(i) == (FileState.COMPACTED, new_id) for i in old_ids):
        return True
    bad = {i: found[i][0].value if i in found else "missing" for i in old_ids
           if i not in found or found[i][0] not in REGISTERED}
    if bad:
        raise ReplaceConflict(f"cannot replace {sorted(old_ids)} by {new_id}: not registered {bad}")
    return False


def merged_coverage(new_id: str, recs: Iterable[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """The old files' coverage rows as the new file's, one row per segment."""
    by_seq: dict[int, tuple[tuple[str, int, int], set[int]]] = {}
    for r in recs:
        where = (r["source_id"], r["shard"], r["slot"])
        seen = by_seq.setdefault(r["segment_seq"], (where, set()))
        if seen[0] != where:
            raise ValueError(f"replace mixes {seen[0]} and {where} in segment {r['segment_seq']}: "
                             "a lake file covers one (source, shard, slot)")
        seen[1].update(decode_indexes(r["bundle_indexes"]))
    return [(new_id, *where, seq, encode_indexes(tuple(sorted(idx))))
            for seq, (where, idx) in sorted(by_seq.items())]


def set_state_query(file_id: str, state: FileState, pairs: Sequence[tuple[str, Any]],
                    now_ns: int, only_from: Iterable[FileState] | None = None
                    ) -> tuple[str, list[Any]]:
    sql = "UPDATE files SET " + "".join(f"{c} = ?, " for c, _ in pairs)
    sql += "state = ?, updated_at = ? WHERE file_id = ?"
    args = [*(v for _, v in pairs), FileState(state).value, now_ns, file_id]
    if only_from is not None:
        allowed = [FileState(s).value for s in only_from]
        sql += " AND state IN (" + ", ".join("?" * len(allowed)) + ")"
        args += allowed
    return sql, args


def index_state(file_id: str, state: str | None) -> FileState:
    """The state record_index leaves a file in."""
    if state is None:
        raise KeyError(file_id)
    if FileState(state) is FileState.EVICTED:
        return FileState.EVICTED
    if FileState(state) in (FileState.META_REGISTERED, FileState.INDEXED):
        return FileState.INDEXED
    raise StateConflict(f"{file_id} is {state}: only a registered file gets zone maps")


def delete_rows_sql(n: int) -> list[str]:
    """Statements (each taking the same n ids) that drop deletable rows and what hangs on them."""
    doomed = f"SELECT file_id FROM files WHERE file_id IN {in_list(n)} AND state IN {DELETABLE_SQL}"
    return [f"DELETE FROM coverage WHERE file_id IN ({doomed})",
            f"DELETE FROM zone_maps WHERE file_id IN ({doomed})",
            f"DELETE FROM files WHERE file_id IN {in_list(n)} AND state IN {DELETABLE_SQL}"]


def replace_inputs_sql(n: int) -> tuple[str, str]:
    """Old rows (file_id, state, compacted_into) and their coverage, for n old ids."""
    ids = in_list(n)
    return (f"SELECT file_id, state, compacted_into FROM files WHERE file_id IN {ids} "
            "ORDER BY file_id",
            "SELECT source_id, shard, slot, segment_seq, bundle_indexes FROM coverage "
            f"WHERE file_id IN {ids}")


def zone_maps_sql(n: int) -> str:
    return ("SELECT file_id, column_name, min_value, max_value, null_count FROM zone_maps "
            f"WHERE file_id IN {in_list(n)} ORDER BY file_id, column_name")


def compact_sql(n: int) -> str:
    """Marks n old rows Compacted; arguments: new id, now, the old ids."""
    return (f"UPDATE files SET state = '{FileState.COMPACTED.value}', compacted_into = ?, "
            f"updated_at = ? WHERE file_id IN {in_list(n)}")


def zone_map_values(file_id: str, zone_maps: Sequence[ZoneMap]) -> list[tuple[Any, ...]]:
    return [(file_id, z.column, _scalar(z.min_value), _scalar(z.max_value), z.null_count)
            for z in zone_maps]


def zone_map_from_record(rec: Mapping[str, Any]) -> ZoneMap:
    return ZoneMap(column=rec["column_name"], min_value=msgspec.json.decode(rec["min_value"]),
                   max_value=msgspec.json.decode(rec["max_value"]), null_count=rec["null_count"])


def _scalar(value: object) -> str:
    if value is not None and not isinstance(value, int | float | str):
        raise TypeError(f"zone map values are JSON scalars, not {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        # JSON has no NaN/inf (msgspec would write null, read back as "all null").
        raise ValueError(f"zone map value {value} is not finite: leave the column out")
    return msgspec.json.encode(value).decode()


def list_files_query(*, client: str | None, since_ns: int | None, until_ns: int | None,
                     states: Iterable[FileState] | None, node_id: str | None,
                     source_id: str | None, slot: int | None,
                     limit: int | None, newest_first: bool = False
                     ) -> tuple[str, list[Any]] | None:
    """SQL and arguments for list_files; None when the answer is empty without asking."""
    where: list[str] = []
    args: list[Any] = []
    for column, value in (("client_name", client), ("node_id", node_id),
                          ("source_id", source_id), ("slot", slot)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    if since_ns is not None:
        where.append("end_ts >= ?")
        args.append(since_ns)
    if until_ns is not None:
        where.append("start_ts < ?")
        args.append(until_ns)
    if states is not None:
        wanted = sorted({FileState(s) for s in states})
        if not wanted:
            return None
        where.append(f"state IN {_in_states(wanted)}")
    sql = SELECT_FILES + (" WHERE " + " AND ".join(where) if where else "")
    order = " DESC" if newest_first else ""
    sql += f" ORDER BY start_ts{order}, file_id{order}"
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, not {limit}")
        sql += " LIMIT ?"
        args.append(limit)
    return sql, args


def lock_key(source_id: str, shard: int) -> int:
    """A stable signed 64-bit key for PostgreSQL's advisory lock of one (source, shard).

    Not Python's hash(): it differs between processes, and every process must agree.
    """
    digest = hashlib.blake2b(f"quiver/coverage/{source_id}/{shard}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big", signed=True)
