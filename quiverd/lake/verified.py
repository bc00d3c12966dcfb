"""Lake files read back with their integrity checked: every Parquet page carries a
checksum (``ActiveFile`` writes them, ``write_page_checksum=True``), which pyarrow only
verifies when asked. Without it a damaged page reads as wrong values, with no error.

Everything in quiverd that reads lake Parquet data (the Spark reader, compaction, zone
maps computed from data) opens files here; a checksum failure or undecodable Parquet
becomes one ``LakeFileCorrupt`` naming the file id and URI.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from quiverd.kernel.errors import LakeFileCorrupt


def open_verified(source: str | Path | pa.NativeFile, *, file_id: str, uri: str
                  ) -> pq.ParquetFile:
    """A ParquetFile whose page reads verify each page's checksum (the writer puts one on
    every page): damaged bytes raise LakeFileCorrupt instead of reading as wrong values.
    The footer has no checksum of its own; damage there fails to decode, and is turned
    into LakeFileCorrupt too."""
    try:
        return pq.ParquetFile(source, page_checksum_verification=True)
    except (OSError, pa.ArrowInvalid) as exc:
        if not is_damage(exc):
            raise
        raise corrupt_error(exc, file_id=file_id, uri=uri) from exc


def read_verified(path: Path, *, file_id: str = "", uri: str = "") -> pa.Table:
    """The whole file as one table, every page checksum verified (see open_verified)."""
    try:
        return open_verified(path, file_id=file_id, uri=uri or path.as_uri()).read()
    except (OSError, pa.ArrowInvalid) as exc:
        if not is_damage(exc):
            raise
        raise corrupt_error(exc, file_id=file_id, uri=uri or path.as_uri()) from exc


def is_damage(exc: BaseException) -> bool:
    """Is this pyarrow read error about the bytes (checksum, thrift, decompression,
    magic), rather than I/O (errno set) or the store (its own exception types)?"""
    if isinstance(exc, LakeFileCorrupt | pa.ArrowInvalid):
        return True
    return type(exc) is OSError and exc.errno is None


def corrupt_error(exc: BaseException, *, file_id: str, uri: str) -> LakeFileCorrupt:
    """One clear error for a damaged lake file: which file, what failed, what to do."""
    if isinstance(exc, LakeFileCorrupt):
        return exc
    text = " ".join(str(exc).split())
    what = ("failed its page checksum" if "checksum" in text.lower()
            else "cannot be decoded (damaged Parquet)")
    name = f"lake file {file_id} ({uri})" if file_id else f"lake file {uri}"
    return LakeFileCorrupt(f"{name} {what}: {text}; none of its rows were returned")


__all__ = ["corrupt_error", "is_damage", "open_verified", "read_verified"]
