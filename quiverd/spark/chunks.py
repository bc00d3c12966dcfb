"""A task attempt's rows as bundles: batches grouped into chunks (``rechunk``), each
chunk one Arrow IPC stream halved by rows until it fits the daemon's max_bundle_bytes
(``encode_bounded``), each tagged with the attempt's rows before it and chained into its
CRC-32C as sent (``AttemptStream``). No pyspark here; quiverd/spark/writer.py drives it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pyarrow as pa

from quiverd.client import IpcPayload
from quiverd.kernel.bundle import TxnTag
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import QuiverError


class WriteRefused(QuiverError):
    """The job's rows can never be written as they are: it fails once, at commit."""


class RowTooLarge(WriteRefused):
    """One row is larger than the daemon's max_bundle_bytes: no bundle can hold it."""


class AttemptStream:
    """Bundles of one attempt: each tagged with the rows before it, checksummed as sent."""

    def __init__(self, tag: TxnTag) -> None:
        self.tag = tag
        self.rows = 0
        self.checksum = 0

    def items(self, chunks: Iterable[list[pa.RecordBatch]], max_bundle_bytes: int
              ) -> Iterator[tuple[IpcPayload, TxnTag]]:
        for chunk in chunks:
            for ipc, rows in encode_bounded(chunk, max_bundle_bytes):
                tag = TxnTag(job_id=self.tag.job_id, partition=self.tag.partition,
                             attempt=self.tag.attempt, row_offset=self.rows)
                self.rows += rows
                self.checksum = crc32c(ipc, self.checksum)
                yield IpcPayload(ipc=ipc, rows=rows), tag


def rechunk(batches: Iterable[pa.RecordBatch], *, max_rows: int, max_bytes: int
            ) -> Iterator[list[pa.RecordBatch]]:
    """Group (and slice, without copying) batches into chunks of at most ``max_rows``
    rows and about ``max_bytes`` bytes, estimated from each batch's bytes per row."""
    group: list[pa.RecordBatch] = []
    rows = size = 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        row_bytes = max(1, batch.nbytes // batch.num_rows)
        start = 0
        while start < batch.num_rows:
            fit = min(batch.num_rows - start, max_rows - rows, (max_bytes - size) // row_bytes)
            if fit <= 0 and group:
                yield group
                group, rows, size = [], 0, 0
                continue
            fit = max(fit, 1)  # one row above max_bytes goes alone: encode_bounded judges it
            group.append(batch.slice(start, fit))
            rows, size, start = rows + fit, size + fit * row_bytes, start + fit
    if group:
        yield group


def encode_bounded(group: list[pa.RecordBatch], limit: int) -> Iterator[tuple[memoryview, int]]:
    """One IPC stream per chunk, halved by rows until each fits ``limit`` bytes; a single
    row that does not fit raises RowTooLarge."""
    rows = sum(b.num_rows for b in group)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, group[0].schema) as writer:
        for batch in group:
            writer.write_batch(batch)
    ipc = memoryview(sink.getvalue())
    if ipc.nbytes <= limit:
        yield ipc, rows
        return
    if rows <= 1:
        raise RowTooLarge(f"a row of {ipc.nbytes} bytes (as Arrow IPC) is larger than the "
                          f"daemon's ingest.max_bundle_bytes of {limit}: no bundle can hold "
                          "it; raise ingest.max_bundle_bytes (and wal.max_entry_bytes) or "
                          "write smaller rows")
    head, tail = _split(group, rows // 2)
    yield from encode_bounded(head, limit)
    yield from encode_bounded(tail, limit)


def _split(group: list[pa.RecordBatch], n: int) -> tuple[list[pa.RecordBatch],
                                                          list[pa.RecordBatch]]:
    head: list[pa.RecordBatch] = []
    tail: list[pa.RecordBatch] = []
    for batch in group:
        take = min(max(n, 0), batch.num_rows)
        if take:
            head.append(batch.slice(0, take))
        if take < batch.num_rows:
            tail.append(batch.slice(take))
        n -= take
    return head, tail
