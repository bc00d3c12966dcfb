"""Lake objects for the Spark reader's executors: one input partition per file, opened
through OpenDAL (no Hadoop jars) as a seekable file for pyarrow, and the errors a read
of a damaged, missing or quarantined file ends with (each names the file id and URI,
with the hint in the message: Spark shows only the message)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import opendal
import pyarrow as pa
import pyarrow.parquet as pq
from opendal.layers import RetryLayer, TimeoutLayer
from pyspark.sql.datasource import InputPartition

from quiverd.kernel.errors import LakeFileCorrupt, LakeFileMissing
from quiverd.lake.model import FileRow
from quiverd.lake.verified import corrupt_error, is_damage, open_verified


@dataclass(frozen=True)
class FilePartition(InputPartition):
    """One lake file, and all an executor needs to read it."""

    key: str
    scheme: str
    store_options: dict[str, str]  # OpenDAL's service options, root included
    timeout_ms: int
    max_attempts: int
    file_id: str = ""  # for errors: which lake file, where
    uri: str = ""
    size: int = 0  # the catalog's compressed_size; 0: not checked


def open_object(p: FilePartition) -> pa.PythonFile:
    """A seekable file over the object: pyarrow's reads become OpenDAL range reads."""
    return pa.PythonFile(open_reads(p), mode="r")


def open_reads(p: FilePartition) -> FullReads:
    """The object, opened for reads, after a stat: LakeFileMissing when it is absent,
    LakeFileCorrupt when its size is not the catalog's (one request, no data read)."""
    op = opendal.Operator(p.scheme, **p.store_options)
    timeout_s = p.timeout_ms / 1000
    op = op.layer(RetryLayer(max_times=max(p.max_attempts - 1, 0), jitter=True))
    op = op.layer(TimeoutLayer(timeout=timeout_s, io_timeout=timeout_s))
    try:
        size = op.stat(p.key).content_length
        if p.size and size != p.size:
            raise with_hint(LakeFileCorrupt(
                f"lake file {p.file_id} ({p.uri}) is {size} bytes in the store, the catalog "
                f"says {p.size}; none of its rows were returned"))
        return FullReads(op.open(p.key, "rb"))
    except opendal.exceptions.NotFound:
        raise missing_error(p) from None


def missing_error(p: FilePartition) -> LakeFileMissing:
    """The catalog lists the file, the store has no object: say which and what to do."""
    name = f"lake file {p.file_id} ({p.uri})" if p.file_id else f"lake object {p.key!r}"
    return LakeFileMissing(f"{name} is registered in the catalog but missing from the "
                           f"object store: {LakeFileMissing.hint}")


def with_hint(exc: LakeFileCorrupt) -> LakeFileCorrupt:
    """The error with its hint in the message: Spark shows the message only."""
    return LakeFileCorrupt(f"{exc} hint: {exc.hint}", hint=exc.hint)


def quarantined_error(selection: str, rows: list[FileRow]) -> LakeFileCorrupt:
    """Quarantined files in the selection: their rows cannot be read, so the read fails
    rather than return a DataFrame silently missing them."""
    files = ", ".join(f"{r.file_id} ({r.row_count} rows)" for r in rows[:5])
    more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
    many = len(rows) > 1
    return LakeFileCorrupt(
        f"{selection}: lake file{'s' * many} "
        f"{files}{more} failed an integrity check and {'are' if many else 'is'} "
        'quarantined; read the rest with .option("skip_quarantined", "true"), or put a '
        "backup back with `quiverd files restore FILE_ID --from PATH` (`quiverd files "
        "forget FILE_ID` records a file as lost; the damaged copy is under quarantine/ "
        "in the store)")


class FullReads:
    """An OpenDAL file whose ``read(n)`` returns n bytes unless the object ends first.

    OpenDAL's ``File.read(n)`` returns at most one chunk (2 MiB in 0.47), and pyarrow
    takes a short read for the end of the file: a row group over 2 MiB then failed with
    "File too short". Everything else is the wrapped file's.
    """

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.gone = False  # the object vanished while it was read (pyarrow hides why)

    def read(self, size: int = -1) -> bytes:
        try:
            return self._read(size)
        except opendal.exceptions.NotFound:
            self.gone = True
            raise

    def _read(self, size: int) -> bytes:
        if size is None or size < 0:
            return bytes(self.raw.read())
        parts: list[bytes] = []
        want = size
        while want > 0:
            chunk = bytes(self.raw.read(want))
            if not chunk:
                break
            parts.append(chunk)
            want -= len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


@contextmanager
def verified_file(p: FilePartition) -> Iterator[pq.ParquetFile]:
    """``p``'s object opened with its page checksums verified (a damaged page fails the
    read, never wrong values); reading it, a gone object is LakeFileMissing and damage a
    LakeFileCorrupt naming the file, both with the hint; closed at the end."""
    reads = open_reads(p)
    source = pa.PythonFile(reads, mode="r")
    uri = p.uri or p.key
    try:
        yield open_verified(source, file_id=p.file_id, uri=uri)
    except opendal.exceptions.NotFound:
        raise missing_error(p) from None
    except LakeFileCorrupt as exc:  # the footer: open_verified's own error
        raise with_hint(exc) from None
    except (OSError, pa.ArrowInvalid) as exc:
        if reads.gone:
            raise missing_error(p) from None
        if not is_damage(exc):
            raise
        raise with_hint(corrupt_error(exc, file_id=p.file_id, uri=uri)) from None
    finally:
        source.close()
