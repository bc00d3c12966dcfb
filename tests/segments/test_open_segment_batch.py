"""OpenSegment.add_batch: a commit batch added at once is the segment bundle-by-bundle adds make.

The batch path extends streams once per group and checks each schema object once; the
manifest, the streams and the encoded segment bytes must not tell the difference from
``add(b, from_wal=True)`` per bundle, for any mix of clients, slots, schemas (shared
schema objects as ingest's SchemaCache hands them out, or one per bundle), metadata
variants, schema drift, multi-batch and empty streams, transactional bundles, end
markers, solo-stream schemas and slots that came without validation facts.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from quiverd.kernel.bundle import Bundle, Slot, TxnTag, encode_ipc_stream, inspect_ipc_stream
from quiverd.kernel.jobs import END_OFFSET, end_marker_table
from quiverd.segments.format import encode_segment
from quiverd.segments.open_segment import Fetch, OpenSegment, Stream


class Slots:
    """Slots with validation facts; ``shared``: one schema object per schema, as ingest."""

    def __init__(self, shared: bool) -> None:
        self.shared = shared
        self.schemas: dict[bytes, pa.Schema] = {}

    def __call__(self, slot: int, data: pa.Table | bytes, *, facts: bool = True) -> Slot:
        ipc = data if isinstance(data, bytes) else encode_ipc_stream(data)
        found = inspect_ipc_stream(ipc)
        if not facts:
            return Slot(slot=slot, fingerprint=found.fingerprint, row_count=found.rows, ipc=ipc)
        schema = found.schema
        if self.shared:
            schema = self.schemas.setdefault(schema.serialize().to_pybytes(), schema)
        return Slot(slot=slot, fingerprint=found.fingerprint, row_count=found.rows, ipc=ipc,
                    schema=schema, batches=found.batches)


def tables() -> dict[str, pa.Table | bytes]:
    plain = pa.table({"a": pa.array(range(40), pa.int64()), "s": [f"x{i}" for i in range(40)]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, plain.schema):
        pass  # an empty stream: schema and EOS only
    return {
        "plain": plain,
        "plain2": plain.slice(5, 7),
        "multi": pa.Table.from_batches([plain.slice(0, 10).to_batches()[0],
                                        plain.slice(10, 20).to_batches()[0],
                                        plain.slice(30, 3).to_batches()[0]]),
        "meta": plain.replace_schema_metadata({"origin": "b"}),
        "drift": pa.table({"a": pa.array([1.5, 2.5])}),
        "dicts": pa.table({"d": pa.array(["a", "b", "a"]).dictionary_encode()}),
        "dicts2": pa.table({"d": pa.array(["c", "a", "c"]).dictionary_encode()}),
        "nested": pa.table({"l": pa.array([["p"], ["q", "p"]],
                                          pa.list_(pa.dictionary(pa.int8(), pa.utf8())))}),
        "empty": sink.getvalue().to_pybytes(),
        "end": end_marker_table(3, 99),
    }


def bundles(shared: bool) -> list[Bundle]:
    """36 bundles from 3 clients over slots 0..4; bundle 29 has a slot without facts."""
    t, slot = tables(), Slots(shared)
    pattern = [
        [("plain", 0)], [("plain", 0), ("dicts", 3)], [("multi", 0)], [("meta", 0)],
        [("plain2", 0), ("dicts2", 3), ("plain", 4)], [("drift", 0)], [("empty", 0)],
        [("nested", 1)], [("plain", 0), ("nested", 1), ("multi", 2)], [("dicts", 3)],
        [("plain", 2)], [("meta", 0), ("plain", 1)],
    ]
    out: list[Bundle] = []
    for i in range(36):
        txn = None
        if i in (13, 14):
            txn = TxnTag(job_id="j", partition=2, attempt=1, row_offset=40 * (i - 13))
        slots = tuple(slot(s, t[name], facts=i != 29)
                      for name, s in pattern[(i * 5) % len(pattern)])
        if i == 15:
            txn, slots = (TxnTag(job_id="j", partition=2, attempt=1, row_offset=END_OFFSET),
                          (slot(0, t["end"]),))
        # Ingestion times are not monotonic across a batch (min/max per stream must hold).
        out.append(Bundle(client=f"client-{i % 3}", slots=slots, txn=txn,
                          ingestion_ts_ns=10_000 + (i * 37) % 50, sequence=100 + i))
    return out


def fetch_from(bundles: list[Bundle]) -> Fetch:
    by_seq = {b.sequence: b for b in bundles}

    def fetch(seqs: list[int]) -> dict[int, dict[int, bytes | bytearray | memoryview]]:
        return {s: {sl.slot: memoryview(bytes(sl.ipc)) for sl in by_seq[s].slots}
                for s in seqs}
    return fetch


def one_by_one(bs: list[Bundle]) -> OpenSegment:
    segment = OpenSegment()
    for b in bs:
        segment.add(b, from_wal=True)
    return segment


def state(segment: OpenSegment) -> tuple[object, ...]:
    """Everything the encoder and the finalizer read, before load."""
    streams = [(s.slot, s.fingerprint, [x.serialize().to_pybytes() for x in s.schemas], s.rows,
                s.min_ts, s.max_ts, [b is None for b in s.batches]) for s in segment.streams]
    return (segment.entries, streams, segment.bytes, segment.unloaded, segment.first_sequence,
            segment.last_sequence, segment.min_ts, segment.max_ts)


def encoded(segment: OpenSegment, bs: list[Bundle]) -> bytes:
    segment.load(fetch_from(bs))
    return b"".join(bytes(p) for p in encode_segment(segment, max_dictionary_cardinality=1000))


@pytest.mark.parametrize("shared", [True, False], ids=["shared-schemas", "schema-per-bundle"])
@pytest.mark.parametrize("cuts", [(), (1, 2, 3, 7, 16, 29, 30), (5, 15, 28)],
                         ids=["one-batch", "small-batches", "batches"])
def test_add_batch_same_manifest_streams_and_bytes_as_add_one_by_one(shared, cuts):
    bs = bundles(shared)
    expected = one_by_one(bs)
    segment = OpenSegment()
    edges = [0, *cuts, len(bs)]
    for lo, hi in zip(edges, edges[1:], strict=False):
        assert segment.add_batch(bs[lo:hi]) == hi - lo
    assert state(segment) == state(expected)
    assert segment.staged() == expected.staged()
    assert encoded(segment, bs) == encoded(expected, bs)


def test_add_batch_without_decode_stops_before_a_slot_without_facts():
    bs = bundles(shared=True)
    segment = OpenSegment()
    assert segment.add_batch(bs[20:], decode=False) == 9  # bundle 29 would need a decode
    assert [e.sequence for e in segment.entries] == [b.sequence for b in bs[20:29]]
    assert segment.add_batch(bs[29:]) == 7  # the rest, decoding bundle 29
    expected = one_by_one(bs[20:])
    assert state(segment) == state(expected)
    assert segment.entries[9].in_wal is False  # held: it came without facts


def test_add_batch_checks_each_schema_once_per_group(monkeypatch):
    """Per bundle no schema comparison: one variant check per (slot, fingerprint, schema)."""
    t, slot = tables(), Slots(shared=True)
    bs = [Bundle(client=f"c{i % 4}", sequence=i + 1, ingestion_ts_ns=i,
                 slots=(slot(0, t["plain" if i % 2 else "plain2"]), slot(3, t["dicts"])))
          for i in range(40)]
    calls: list[int] = []
    segment = OpenSegment()
    real = Stream.variant

    def counting(self, schema):  # type: ignore[no-untyped-def]
        calls.append(self.slot)
        return real(self, schema)

    monkeypatch.setattr(Stream, "variant", counting)
    segment.add_batch(bs)
    assert sorted(calls) == [0, 3]
    assert state(segment) == state(one_by_one(bs))
    assert len(calls) == 2 + 2 * len(bs)  # one_by_one: one check per slot of every bundle


def test_add_batch_keeps_few_schema_objects_when_each_bundle_brings_its_own(monkeypatch):
    monkeypatch.setattr("quiverd.segments.open_segment.SOLO_CACHE_SCHEMAS", 4)
    t, slot = tables(), Slots(shared=False)
    bs = [Bundle(client="c", sequence=i + 1, ingestion_ts_ns=i, slots=(slot(0, t["plain"]),))
          for i in range(10)]
    segment = OpenSegment()
    segment.add_batch(bs)
    assert len(segment._solo) <= 4
    assert state(segment) == state(one_by_one(bs))
