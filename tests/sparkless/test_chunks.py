"""quiverd.spark.chunks without Spark or a daemon: a task attempt's batches grouped into
chunks by rows and bytes, each encoded as Arrow IPC streams halved until they fit the
daemon's frame limit, tagged with the rows before them and chained into the checksum."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from quiverd.kernel.bundle import TxnTag, read_ipc_stream
from quiverd.kernel.crc import crc32c
from quiverd.spark.chunks import (
    AttemptStream,
    RowTooLarge,
    WriteRefused,
    encode_bounded,
    rechunk,
)


def batch(start: int, n: int) -> pa.RecordBatch:
    ids = pa.array(range(start, start + n), pa.int64())
    return pa.record_batch([ids, pc.cast(ids, pa.utf8())], ["id", "s"])


def ids(chunks: list[list[pa.RecordBatch]]) -> list[int]:
    return [i for c in chunks for b in c for i in b["id"].to_pylist()]


def test_rechunk_bounds_rows_and_bytes_and_keeps_every_row_in_order() -> None:
    batches = [batch(0, 10), batch(10, 0), batch(10, 25), batch(35, 3)]
    chunks = list(rechunk(batches, max_rows=8, max_bytes=1 << 20))
    assert [sum(b.num_rows for b in c) for c in chunks] == [8, 8, 8, 8, 6]
    assert ids(chunks) == list(range(38))
    by_bytes = list(rechunk([batch(0, 1000)], max_rows=10_000, max_bytes=4000))
    # Bytes are estimated from the batch's average row: about, not exactly, 4000.
    assert len(by_bytes) >= 3
    assert all(sum(b.nbytes for b in c) <= 4000 * 1.25 for c in by_bytes)
    assert sum(b.num_rows for c in by_bytes for b in c) == 1000
    assert [len(c) for c in rechunk([batch(0, 3)], max_rows=5, max_bytes=1)] == [1, 1, 1]


def test_rechunk_joins_small_batches_and_slices_without_copying() -> None:
    first, second = batch(0, 3), batch(3, 4)
    (chunk,) = rechunk([first, second], max_rows=10, max_bytes=1 << 20)
    assert [b.num_rows for b in chunk] == [3, 4] and ids([chunk]) == list(range(7))
    big = batch(0, 10)
    chunks = list(rechunk([big], max_rows=4, max_bytes=1 << 20))
    assert [b.num_rows for c in chunks for b in c] == [4, 4, 2]
    address = big.column(0).buffers()[1].address
    assert {c[0].column(0).buffers()[1].address for c in chunks} == {address}  # slices
    # A chunk left part full takes the next batch's first rows.
    mixed = list(rechunk([batch(0, 5), batch(5, 5)], max_rows=4, max_bytes=1 << 20))
    assert [[b.num_rows for b in c] for c in mixed] == [[4], [1, 3], [2]]
    assert ids(mixed) == list(range(10))


def test_rechunk_by_bytes_counts_each_batch_at_its_own_row_size() -> None:
    wide = pa.record_batch([pa.array(["x" * 1000] * 6)], ["s"])
    narrow = pa.record_batch([pa.array(["y"] * 6)], ["s"])
    row_wide = wide.nbytes // wide.num_rows
    chunks = list(rechunk([narrow, wide], max_rows=100, max_bytes=3 * row_wide))
    rows = [[b.num_rows for b in c] for c in chunks]
    # The 6 narrow rows and 2 wide ones fit the first chunk; then 3 wide rows per chunk.
    assert rows == [[6, 2], [3], [1]], rows
    assert sum(sum(r) for r in rows) == 12


def test_rechunk_of_nothing_is_no_chunk() -> None:
    assert list(rechunk([], max_rows=4, max_bytes=1 << 20)) == []
    assert list(rechunk([batch(0, 0), batch(0, 0)], max_rows=4, max_bytes=1 << 20)) == []


def test_encode_bounded_halves_a_chunk_until_it_fits() -> None:
    group = [batch(0, 600), batch(600, 400)]
    whole = list(encode_bounded(group, 1 << 20))
    assert len(whole) == 1 and whole[0][1] == 1000
    parts = list(encode_bounded(group, whole[0][0].nbytes // 3))
    assert len(parts) > 2 and all(ipc.nbytes <= whole[0][0].nbytes // 3 for ipc, _ in parts)
    back = pa.concat_tables([read_ipc_stream(ipc) for ipc, _ in parts])
    assert back["id"].to_pylist() == list(range(1000))
    assert [rows for _, rows in parts] == [len(read_ipc_stream(i)) for i, _ in parts]


def test_encode_bounded_one_stream_when_it_fits_exactly() -> None:
    group = [batch(0, 5)]
    ((ipc, rows),) = encode_bounded(group, 1 << 20)
    assert list(encode_bounded(group, ipc.nbytes))[0][1] == 5  # the limit is inclusive
    assert len(list(encode_bounded(group, ipc.nbytes - 1))) == 2
    assert read_ipc_stream(ipc).equals(pa.Table.from_batches(group)) and rows == 5


def test_encode_bounded_refuses_one_row_larger_than_the_limit() -> None:
    big = pa.record_batch([pa.array([3], pa.int64()), pa.array(["x" * 5000])], ["id", "s"])
    with pytest.raises(RowTooLarge,
                       match=r"a row of \d+ bytes .* ingest\.max_bundle_bytes of 4096:"):
        list(encode_bounded([batch(0, 3), big], 4096))
    # The rows before it were encoded first; the job fails once, at commit.
    assert issubclass(RowTooLarge, WriteRefused)
    with pytest.raises(RowTooLarge, match=r"raise ingest\.max_bundle_bytes \(and "
                       r"wal\.max_entry_bytes\) or write smaller rows"):
        list(encode_bounded([big], 4096))


def test_attempt_stream_tags_offsets_and_chains_the_checksum_over_what_is_sent() -> None:
    stream = AttemptStream(TxnTag(job_id="j", partition=3, attempt=42, row_offset=0))
    items = list(stream.items(rechunk([batch(0, 10)], max_rows=4, max_bytes=1 << 20), 1 << 20))
    assert [tag.row_offset for _, tag in items] == [0, 4, 8]
    assert {(t.job_id, t.partition, t.attempt) for _, t in items} == {("j", 3, 42)}
    crc = 0
    for payload, _ in items:
        crc = crc32c(payload.ipc, crc)
    assert (stream.rows, stream.checksum) == (10, crc)


def test_attempt_stream_offsets_continue_across_halved_chunks() -> None:
    chunks = list(rechunk([batch(0, 300), batch(300, 100)], max_rows=200, max_bytes=1 << 20))
    limit = next(encode_bounded(chunks[0], 1 << 20))[0].nbytes // 2
    stream = AttemptStream(TxnTag(job_id="j", partition=0, attempt=1, row_offset=0))
    items = list(stream.items(chunks, limit))
    assert len(items) > len(chunks)  # halved
    offsets = [tag.row_offset for _, tag in items]
    rows = [payload.rows for payload, _ in items]
    assert offsets == [sum(rows[:i]) for i in range(len(rows))]
    back = pa.concat_tables([read_ipc_stream(p.ipc) for p, _ in items])
    assert back["id"].to_pylist() == list(range(400)) and stream.rows == 400


def test_attempt_stream_a_row_too_large_stops_the_attempt() -> None:
    big = pa.record_batch([pa.array([0], pa.int64()), pa.array(["x" * 5000])], ["id", "s"])
    stream = AttemptStream(TxnTag(job_id="j", partition=0, attempt=1, row_offset=0))
    items = stream.items([[batch(0, 2)], [big]], 4096)
    payload, tag = next(items)
    assert (payload.rows, tag.row_offset) == (2, 0)
    with pytest.raises(RowTooLarge):
        next(items)
    assert stream.rows == 2  # only what was sent counts
