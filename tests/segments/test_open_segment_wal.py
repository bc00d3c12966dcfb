"""Bundles left in the WAL: the open segment keeps no payload, the finalizer reads it back.

The segment a lazily built open segment encodes (after ``load``) must be byte for byte
the one the same bundles encode when held in memory; a payload that no longer matches
what ingest validated is refused, not written.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from quiverd.kernel.bundle import Bundle, Slot, TxnTag, encode_ipc_stream, inspect_ipc_stream
from quiverd.segments.format import encode_segment
from quiverd.segments.open_segment import OpenSegment


def _slot(slot: int, data: pa.Table | pa.RecordBatch | bytes) -> Slot:
    ipc = data if isinstance(data, bytes) else encode_ipc_stream(data)
    facts = inspect_ipc_stream(ipc)
    return Slot(slot=slot, fingerprint=facts.fingerprint, row_count=facts.rows, ipc=ipc,
                schema=facts.schema, batches=facts.batches)


def _bundles() -> list[Bundle]:
    plain = pa.table({"a": pa.array(range(50), pa.int64()), "s": [f"x{i}" for i in range(50)]})
    multi = pa.Table.from_batches([plain.slice(0, 10).to_batches()[0],
                                   plain.slice(10, 30).to_batches()[0]])
    dicts = pa.table({"d": pa.array(["a", "b", "a"]).dictionary_encode()})
    dicts2 = pa.table({"d": pa.array(["c", "a", "c"]).dictionary_encode()})
    nested = pa.table({"l": pa.array([["p"], ["q", "p"]],
                                     pa.list_(pa.dictionary(pa.int8(), pa.utf8())))})
    meta = plain.replace_schema_metadata({"origin": "b"})
    drift = pa.table({"a": pa.array([1.5, 2.5])})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, plain.schema):
        pass  # an empty stream: schema and EOS only
    empty = sink.getvalue().to_pybytes()
    slot_sets = [
        [_slot(0, plain)], [_slot(0, multi), _slot(3, dicts)], [_slot(3, dicts2)],
        [_slot(1, nested)], [_slot(0, meta)], [_slot(0, drift)], [_slot(0, empty)],
        [_slot(0, plain), _slot(1, nested), _slot(2, multi)],
    ]
    txn = TxnTag(job_id="j", partition=1, attempt=7, row_offset=0)
    return [Bundle(client=f"c{i % 2}", slots=tuple(s), ingestion_ts_ns=1000 + i, sequence=10 + i,
                   txn=txn if i == 4 else None) for i, s in enumerate(slot_sets)]


def _fetch_from(bundles: list[Bundle], calls: list[list[int]]):
    def fetch(seqs: list[int]) -> dict[int, dict[int, memoryview]]:
        calls.append(list(seqs))
        by_seq = {b.sequence: b for b in bundles}
        return {s: {sl.slot: memoryview(bytes(sl.ipc)) for sl in by_seq[s].slots} for s in seqs}
    return fetch


def _encode(segment: OpenSegment) -> bytes:
    return b"".join(bytes(p) for p in encode_segment(segment, max_dictionary_cardinality=1000))


def test_open_segment_from_wal_encodes_the_same_bytes_as_held_bundles():
    bundles = _bundles()
    held, lazy = OpenSegment(), OpenSegment()
    for b in bundles:
        held.add(b)
        lazy.add(b, from_wal=True)
    assert lazy.unloaded == len(bundles)
    assert all(batch is None for st in lazy.streams for batch in st.batches)
    assert (lazy.bytes, lazy.stream_count, lazy.bundle_count) == \
        (held.bytes, held.stream_count, held.bundle_count)
    calls: list[list[int]] = []
    lazy.load(_fetch_from(bundles, calls))
    assert calls == [[b.sequence for b in bundles]]  # one read-back for the whole segment
    assert lazy.unloaded == 0
    assert [st.rows for st in lazy.streams] == [st.rows for st in held.streams]
    assert _encode(lazy) == _encode(held)


def test_open_segment_from_wal_keeps_slots_without_validation_facts_in_memory():
    table = pa.table({"a": [1, 2, 3]})
    ipc = encode_ipc_stream(table)
    bare = Slot(slot=0, fingerprint=inspect_ipc_stream(ipc).fingerprint, row_count=3, ipc=ipc)
    seg = OpenSegment()
    seg.add(Bundle(client="c", slots=(bare,), sequence=1), from_wal=True)
    assert seg.unloaded == 0  # replayed bundles come without facts: decoded and held
    seg.load(lambda seqs: pytest.fail("nothing to read back"))
    assert seg.streams[0].batches[0].num_rows == 3


def test_open_segment_load_refuses_a_payload_unlike_what_ingest_validated():
    bundles = _bundles()[:2]
    seg = OpenSegment()
    for b in bundles:
        seg.add(b, from_wal=True)
    other = encode_ipc_stream(pa.table({"a": pa.array([1], pa.int64()), "s": ["z"]}))

    def fetch(seqs: list[int]) -> dict[int, dict[int, bytes]]:
        out = {s: {sl.slot: sl.ipc for sl in b.slots} for s, b in zip(seqs, bundles, strict=True)}
        out[bundles[1].sequence][0] = other  # one batch where ingest saw two
        return out

    with pytest.raises(ValueError, match="batches read back"):
        seg.load(fetch)


def test_encode_segment_into_a_reused_arena_gives_the_same_bytes():
    from quiverd.segments.format import Arena

    arena = Arena()
    bundles = _bundles()
    first, second = OpenSegment(), OpenSegment()
    for b in bundles:
        first.add(b)
    for b in reversed(bundles):
        second.add(b)
    plain1, plain2 = _encode(first), _encode(second)
    # The first use sizes the arena, later ones encode into the same memory.
    for _ in range(3):
        got1 = b"".join(bytes(p) for p in encode_segment(
            first, max_dictionary_cardinality=1000, arena=arena))
        assert got1 == plain1
        got2 = b"".join(bytes(p) for p in encode_segment(
            second, max_dictionary_cardinality=1000, arena=arena))
        assert got2 == plain2
    assert arena.buffer is not None and arena.used > 0
