"""Files a producer sends: Arrow IPC (file or stream) and Parquet, cut into bundles that fit.

The format is told by the magic bytes, not the file name. Parquet is read one
row group at a time (a row group is the file's own unit; it is never merged
with the next one), IPC one record batch at a time; anything whose encoded size
would pass the daemon's ``max_bundle_bytes`` is cut into row slices that fit.
``FileSplit`` says how each file was cut. Blocking I/O: call from a thread or a
synchronous client.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from quiverd.kernel.errors import NotArrowData

StrPath = str | PathLike[str]
# Room left in a bundle for the IPC stream's schema and batch messages and padding.
SIZE_MARGIN = 0.9


@dataclass
class FileSplit:
    """How one file became bundles."""

    path: str
    unit: str = "record batches"  # or "row groups" (Parquet)
    units: int = 0  # record batches / row groups read
    bundles: int = 0  # bundles produced
    cut: int = 0  # units cut into several bundles to fit max_bundle_bytes
    max_bundle_bytes: int | None = None  # the limit it was cut for

    def describe(self) -> str:
        text = f"{self.path}: {self.units} {self.unit} -> {self.bundles} bundles"
        if self.cut:
            text += (f" ({self.cut} of them cut to fit the daemon's max_bundle_bytes of "
                     f"{self.max_bundle_bytes} bytes)")
        return text


def check_arrow_file(path: StrPath) -> pa.Schema:
    """The schema of ``path`` if it opens as Parquet or Arrow IPC (reads its header only);
    raise NotArrowData otherwise."""
    path = Path(path)
    magic = _magic(path)
    with _readable(path):
        if magic[:4] == b"PAR1":
            return pq.read_schema(path)
        with pa.memory_map(str(path)) as source:
            if magic == b"ARROW1":
                return pa.ipc.open_file(source).schema
            with pa.ipc.open_stream(source) as stream:
                return stream.schema


def iter_file_batches(path: StrPath, *, max_bundle_bytes: int | None = None,
                      split: FileSplit | None = None) -> Iterator[pa.RecordBatch]:
    """Record batches of ``path``, each small enough for one bundle of ``max_bundle_bytes``."""
    split = split if split is not None else FileSplit(str(path))
    split.max_bundle_bytes = max_bundle_bytes
    for batch in _units(Path(path), split=split):
        split.units += 1
        pieces = fit(batch, max_bundle_bytes) if max_bundle_bytes else [batch]
        split.cut += len(pieces) > 1
        split.bundles += len(pieces)
        yield from pieces


def fit(batch: pa.RecordBatch, max_bundle_bytes: int) -> list[pa.RecordBatch]:
    """Row slices of ``batch`` whose buffers fit in ``max_bundle_bytes`` (with a margin).

    A single row larger than that stays whole: the daemon then refuses it with
    a clear TOO_LARGE error instead of the client looping.
    """
    budget = max(int(max_bundle_bytes * SIZE_MARGIN), 1)
    size = batch.get_total_buffer_size()
    if size <= budget or batch.num_rows <= 1:
        return [batch]
    parts = math.ceil(size / budget)
    step = math.ceil(batch.num_rows / parts)
    out: list[pa.RecordBatch] = []
    for start in range(0, batch.num_rows, step):
        piece = batch.slice(start, step)
        # Rows are not all the same size: cut a piece that is still too big again.
        out += fit(piece, max_bundle_bytes) if piece.nbytes > budget else [piece]
    return out


def _units(path: Path, *, split: FileSplit | None = None) -> Iterator[pa.RecordBatch]:
    magic = _magic(path)
    with _readable(path):
        if magic[:4] == b"PAR1":
            yield from _parquet(path, split)
            return
        with pa.memory_map(str(path)) as source:
            if magic == b"ARROW1":
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)
            else:
                with pa.ipc.open_stream(source) as stream:
                    yield from stream


def _magic(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(6)


@contextlib.contextmanager
def _readable(path: Path) -> Iterator[None]:
    """Turn what pyarrow raises on bytes that are not Arrow or Parquet into NotArrowData."""
    try:
        yield
    except (pa.ArrowInvalid, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno is not None:
            raise  # a real I/O error (permission, ...), not a format problem
        raise NotArrowData(f"{path} is not a readable Arrow IPC or Parquet file ({exc})") \
            from None


def _parquet(path: Path, split: FileSplit | None) -> Iterator[pa.RecordBatch]:
    with pq.ParquetFile(path) as pf:
        if split is not None:
            split.unit = "row groups"
        for i in range(pf.num_row_groups):
            table = pf.read_row_group(i).combine_chunks()
            batches = table.to_batches()
            yield batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)
