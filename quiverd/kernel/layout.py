"""Every path of a data directory, named once (SPEC §2). Pure: no I/O.

    <data_dir>/
      LOCK                              flock of the running daemon (or fsck)
      ingest.sock, admin.sock           default socket paths
      shard-<n>/
        wal/quiver.wal                  active WAL
        wal/quiver.wal.<gen>            rotated WAL files, <gen> increasing
        wal/truncate.offset             truncate sidecar (32 bytes)
        segments/<seq:016>.qseg         finalized segments, mode 0440
        segments/<seq:016>.qseg.tmp     a finalize in progress (or cut short)
        segments/FLOOR                  highest segment seq ever finalized
        segments/DELETED                highest WAL sequence of a deleted segment
        ack.log                         subscriber outcomes + checkpoints
        lost.json                       losses already reported (reported once)
        producers.json                  named producers' stored bundle numbers
        quarantine/                     bytes cut out during recovery
      retired.json                      subscribers retired for having no consumer, and why
      lake.id                           this data directory's incarnation (a ULID)
      lake.scrub                        when the last lake scrub pass started (ns, text)
      staging/active/                   Parquet files being appended (Active)
      staging/stable/                   closed Parquet files awaiting upload / eviction
      objects/                          the default object store (OpenDAL fs)
      catalog.sqlite                    the embedded catalog (when catalog.dsn is "")

Other modules ask this one for a path; none spells a file or directory name of
the layout itself, so a layout change touches this file only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

LOCK = "LOCK"
INGEST_SOCKET = "ingest.sock"
ADMIN_SOCKET = "admin.sock"
SHARD_PREFIX = "shard-"
WAL_DIR = "wal"
ACTIVE_WAL = "quiver.wal"
SIDECAR = "truncate.offset"
SEGMENTS_DIR = "segments"
SEGMENT_SUFFIX = ".qseg"
TMP_SUFFIX = ".tmp"
FLOOR = "FLOOR"
DELETED = "DELETED"
ACK_LOG = "ack.log"
LOST_RECORD = "lost.json"
PRODUCERS = "producers.json"
QUARANTINE_DIR = "quarantine"
LAKE_ID = "lake.id"
RETIRED = "retired.json"
LAKE_SCRUB = "lake.scrub"
STAGING_DIR = "staging"
ACTIVE_DIR = "active"
STABLE_DIR = "stable"
OBJECTS_DIR = "objects"
CATALOG_DB = "catalog.sqlite"

_SHARD = re.compile(re.escape(SHARD_PREFIX) + r"(\d+)")
_ROTATED = re.compile(re.escape(ACTIVE_WAL) + r"\.(\d+)")
_SEGMENT = re.compile(r"(\d+)" + re.escape(SEGMENT_SUFFIX))
MARKERS = frozenset({FLOOR, DELETED, FLOOR + TMP_SUFFIX, DELETED + TMP_SUFFIX})


@dataclass(frozen=True)
class DataDir:
    """The top of a data directory."""

    root: Path

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    @property
    def ingest_socket(self) -> Path:
        return self.root / INGEST_SOCKET

    @property
    def admin_socket(self) -> Path:
        return self.root / ADMIN_SOCKET

    def shard(self, index: int) -> ShardLayout:
        return ShardLayout(self.root / f"{SHARD_PREFIX}{index}")

    @property
    def lake_id(self) -> Path:
        return self.root / LAKE_ID

    @property
    def retired(self) -> Path:
        return self.root / RETIRED

    @property
    def staging_active(self) -> Path:
        return self.root / STAGING_DIR / ACTIVE_DIR

    @property
    def staging_stable(self) -> Path:
        return self.root / STAGING_DIR / STABLE_DIR

    @property
    def lake_scrub(self) -> Path:
        return self.root / LAKE_SCRUB

    @property
    def objects(self) -> Path:
        return self.root / OBJECTS_DIR

    @property
    def catalog_db(self) -> Path:
        return self.root / CATALOG_DB


@dataclass(frozen=True)
class ShardLayout:
    """One ``shard-<n>/`` directory and everything in it."""

    dir: Path

    @property
    def wal_dir(self) -> Path:
        return self.dir / WAL_DIR

    @property
    def segments_dir(self) -> Path:
        return self.dir / SEGMENTS_DIR

    @property
    def quarantine_dir(self) -> Path:
        return self.dir / QUARANTINE_DIR

    @property
    def ack_log(self) -> Path:
        return self.dir / ACK_LOG

    @property
    def lost_record(self) -> Path:
        return self.dir / LOST_RECORD

    @property
    def producers(self) -> Path:
        return self.dir / PRODUCERS

    @property
    def floor(self) -> Path:
        return self.segments_dir / FLOOR

    @property
    def deleted(self) -> Path:
        return self.segments_dir / DELETED

    @property
    def active_wal(self) -> Path:
        return active_wal(self.wal_dir)

    @property
    def sidecar(self) -> Path:
        return sidecar(self.wal_dir)

    def segment(self, segment_seq: int) -> Path:
        return segment_path(self.segments_dir, segment_seq)

    def directories(self) -> tuple[Path, ...]:
        """What recovery creates before anything else."""
        return (self.wal_dir, self.segments_dir, self.quarantine_dir)


# ---- names inside a WAL directory --------------------------------------------------
def active_wal(wal_dir: Path) -> Path:
    return wal_dir / ACTIVE_WAL


def rotated_wal(wal_dir: Path, generation: int) -> Path:
    return wal_dir / f"{ACTIVE_WAL}.{generation}"


def sidecar(wal_dir: Path) -> Path:
    return wal_dir / SIDECAR


def rotated_generation(name: str) -> int | None:
    """``quiver.wal.<gen>`` -> gen; anything else -> None."""
    m = _ROTATED.fullmatch(name)
    return int(m.group(1)) if m else None


def is_active_wal(name: str) -> bool:
    return name == ACTIVE_WAL


def wal_quarantine_name(generation: int, offset: int, kind: str) -> str:
    """Bytes replay cut out of WAL generation ``generation`` at ``offset``."""
    return f"{ACTIVE_WAL}.{generation}.{offset}.{kind}"


_WAL_QUARANTINED = re.compile(re.escape(ACTIVE_WAL) + r"\.(\d+)\.(\d+)\.(\w+)")


def parse_wal_quarantine_name(name: str) -> tuple[int, int, str] | None:
    """Inverse of ``wal_quarantine_name``: (generation, offset, kind)."""
    m = _WAL_QUARANTINED.fullmatch(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


# ---- names inside a segments directory ---------------------------------------------
def segment_path(segments_dir: Path, segment_seq: int) -> Path:
    return segments_dir / f"{segment_seq:016d}{SEGMENT_SUFFIX}"


def tmp_path(path: Path) -> Path:
    """Where a crash-safe write of ``path`` stages its bytes."""
    return path.with_name(path.name + TMP_SUFFIX)


def segment_seq_of(name: str) -> int | None:
    """``<seq:016>.qseg`` -> seq; anything else (temp files, markers) -> None."""
    m = _SEGMENT.fullmatch(name)
    return int(m.group(1)) if m else None


def is_segment_tmp(name: str) -> bool:
    return name.endswith(SEGMENT_SUFFIX + TMP_SUFFIX)


def is_marker(name: str) -> bool:
    return name in MARKERS


# ---- shards --------------------------------------------------------------------------
def shard_index(name: str) -> int | None:
    """``shard-<n>`` -> n; anything else -> None."""
    m = _SHARD.fullmatch(name)
    return int(m.group(1)) if m else None


def shard_of(path: Path) -> ShardLayout:
    """The shard directory ``path`` (a file or directory inside it) belongs to."""
    for parent in (path, *path.parents):
        if shard_index(parent.name) is not None:
            return ShardLayout(parent)
    raise ValueError(f"{path} is not inside a {SHARD_PREFIX}<n> directory")


def ack_log_quarantine_name(start: int, kind: str, stamp_ns: int) -> str:
    """Bytes ack.log replay cut out at ``start``; the stamp keeps two repairs apart."""
    return f"{ACK_LOG}.{start:016d}.{kind}.{stamp_ns}"
