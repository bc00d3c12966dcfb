"""Small per-shard marker files, each with one owner, written crash-safely.

    segments/FLOOR     {"segment_seq": N}   highest segment seq ever finalized
                                            (finalizer): numbers never repeat,
                                            even after every segment is deleted
    segments/DELETED   {"wal_sequence": S}  WAL sequences <= S were in segments
                                            deleted on purpose (gc): replay must
                                            not resurrect them
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec

from quiverd.kernel.durable import atomic_write
from quiverd.kernel.errors import CorruptRecord

FLOOR = "FLOOR"
DELETED = "DELETED"

T = TypeVar("T", bound=msgspec.Struct)


class Floor(msgspec.Struct, frozen=True, kw_only=True):
    segment_seq: int = 0


class Deleted(msgspec.Struct, frozen=True, kw_only=True):
    wal_sequence: int = 0


def read_marker(path: Path, kind: type[T]) -> T:
    """Read a marker; a missing file is the zero marker."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=kind)
    except FileNotFoundError:
        return kind()
    except (msgspec.DecodeError, OSError) as exc:
        raise CorruptRecord(str(path), 0, f"marker unreadable: {exc}",
                            hint="restore it from backup, or delete it after checking "
                            "that no higher segment numbers were ever used") from exc


def write_marker(path: Path, marker: msgspec.Struct) -> None:
    atomic_write(path, msgspec.json.encode(marker))
