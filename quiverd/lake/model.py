"""What the uploader, catalog, indexer, janitor and compactor agree on.

A *lake file* is one Parquet object holding the rows of one ``(client, slot)`` of the
bundles of one shard of one data directory, in bundle order. Its catalog row moves
through the lifecycle below; only rows in ``REGISTERED`` states are visible to
readers, and only their coverage counts when the uploader decides whether a
redelivered bundle was already uploaded (exactly once into the lake, SPEC §6).

    Received ─▶ Appended ─▶ Rotated ─▶ Uploaded ─▶ MetaRegistered ─▶ Indexed ─▶ Evicted
        └──────────┴───────────┴──────────┴─▶ Abandoned   (crash before registration)
                               MetaRegistered / Indexed / Evicted ─▶ Compacted
                               MetaRegistered / Indexed / Evicted ─▶ Quarantined
                                   (the object failed its CRC-32C or size check: moved to
                                    quarantine/<key> in the store, see lake.scrub)
                                                          Quarantined ─▶ Lost
                                   (`quiverd files forget`: its rows are given up for lost)
                                         Quarantined / Lost ─▶ Evicted
                                   (`quiverd files restore`: a copy with the row's size and
                                    CRC-32C is back at its key; live again)

Times are integer nanoseconds since the Unix epoch (UTC) in every backend.
"""

from __future__ import annotations

import enum

import msgspec

# Columns the uploader adds to every row: the bundle's ingestion time (timestamp us UTC)
# and its id, on which the slots of one bundle (one file each) rejoin.
INGESTED_AT = "_quiver_ingested_at"
SHARD_COLUMN = "_quiver_shard"
SEGMENT_COLUMN = "_quiver_segment"
BUNDLE_COLUMN = "_quiver_bundle"


class FileState(enum.StrEnum):
    RECEIVED = "Received"  # file opened for its first bundle
    APPENDED = "Appended"  # first row group written to the Active file
    ROTATED = "Rotated"  # Active closed and renamed Stable (footer written)
    UPLOADED = "Uploaded"  # object written and verified (size + CRC32C)
    META_REGISTERED = "MetaRegistered"  # row complete, coverage recorded: the file is live
    INDEXED = "Indexed"  # zone maps recorded (bloom filters are in the file)
    EVICTED = "Evicted"  # local copy deleted; the object stays authoritative
    ABANDONED = "Abandoned"  # never registered (crash or error); its object is deleted
    COMPACTED = "Compacted"  # replaced by ``compacted_into``; object deleted after a grace
    QUARANTINED = "Quarantined"  # object damaged: moved to quarantine/, rows not readable
    LOST = "Lost"  # a quarantined file an operator gave up on: its loss is known, not an error


UNFINISHED = frozenset({FileState.RECEIVED, FileState.APPENDED, FileState.ROTATED,
                        FileState.UPLOADED})
REGISTERED = frozenset({FileState.META_REGISTERED, FileState.INDEXED, FileState.EVICTED})
# Rows whose object key must stay free for the file's restore (the janitor never deletes
# an object they name: it may be the copy an operator just put back).
RESTORABLE = frozenset({FileState.QUARANTINED, FileState.LOST})


class FileRow(msgspec.Struct, kw_only=True):
    """One catalog row (the seed's fields first, then quiverd's)."""

    file_id: str  # ULID
    client_name: str
    uri: str = ""  # the object's URI (s3://bucket/key, file:///…/objects/key); "" before upload
    start_ts: int = 0  # min of the time column, ns
    end_ts: int = 0  # max of the time column, ns
    row_count: int = 0
    uncompressed_size: int = 0  # Arrow bytes appended
    compressed_size: int = 0  # Parquet file bytes
    schema_hash: str = ""  # hex, lake.drift.schema_hash of the file's schema
    indexes: list[str] = msgspec.field(default_factory=list)  # e.g. ["zonemap", "bloom:user_id"]
    uploaded_at: int = 0  # ns
    # quiverd's own fields
    node_id: str = ""
    source_id: str = ""  # the data directory's incarnation (ULID kept in <data_dir>/lake.id)
    shard: int = 0
    slot: int = 0
    object_key: str = ""  # key inside the store's root
    first_segment: int = 0  # bundle range covered: (first_segment, first_bundle) ..
    first_bundle: int = 0
    last_segment: int = 0  # .. (last_segment, last_bundle), inclusive
    last_bundle: int = 0
    bundle_count: int = 0
    crc32c: int = 0  # whole-file CRC-32C of the Parquet bytes
    state: FileState = FileState.RECEIVED
    local_path: str = ""  # the local Parquet file while it exists
    compacted_into: str = ""  # file_id of the file that replaced this one
    created_at: int = 0  # ns
    updated_at: int = 0  # ns


class Coverage(msgspec.Struct, frozen=True, kw_only=True):
    """Bundles of one segment that a file holds (for one slot: the file's)."""

    segment_seq: int
    bundle_indexes: tuple[int, ...]  # sorted, distinct


class ZoneMap(msgspec.Struct, frozen=True, kw_only=True):
    """Per-file min/max/null count of one column; values are JSON scalars
    (timestamps as ns ints, dates as day ints, strings, numbers, bools), None when all null."""

    column: str
    min_value: int | float | str | bool | None
    max_value: int | float | str | bool | None
    null_count: int


class ObjectInfo(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    size: int
    last_modified_ns: int = 0  # 0 when the store does not say


def encode_indexes(indexes: tuple[int, ...]) -> str:
    """Sorted bundle indexes as compact runs: (0, 1, 2, 5, 7, 8) -> "0-2,5,7-8"."""
    runs: list[str] = []
    i = 0
    while i < len(indexes):
        j = i
        while j + 1 < len(indexes) and indexes[j + 1] == indexes[j] + 1:
            j += 1
        runs.append(str(indexes[i]) if i == j else f"{indexes[i]}-{indexes[j]}")
        i = j + 1
    return ",".join(runs)


def decode_indexes(text: str) -> tuple[int, ...]:
    """The inverse of ``encode_indexes``; raises ValueError on malformed text."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad run {part!r}")
        out.extend(range(first, last + 1))
    return tuple(out)
