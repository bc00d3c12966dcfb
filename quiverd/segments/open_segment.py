"""The open segment: one shard's bundles accumulating in memory until sealed.

The segment_builder actor owns it; at seal it moves (``SealedSegment``) to the
finalizer, which encodes it (``quiverd.segments.format``) and writes it. A *stream*
is every chunk of one ``(slot, schema fingerprint)``; schema drift opens a new stream.

Two ways to hold a bundle's data:

- **held**: decoded Arrow batches, zero copy over the slot's IPC payload buffer,
  which stays alive through them (replayed bundles, tests, anything whose slots
  came without validation facts).
- **in the WAL** (``add(..., from_wal=True)``, the ingest path): only what the
  manifest needs is kept (schema and batch count per slot, known from ingest
  validation); the payload buffer is let go, so receive buffers are reused at once
  and the open segment costs no memory per byte. Before encoding, the finalizer
  calls ``load(fetch)``, which reads each such bundle's payloads back from the WAL
  (memory-mapped page cache, still there: the WAL region is released only after the
  segment is durable) and fills the streams in arrival order.

A stream whose schema holds no dictionary is never decoded for its segment: each
chunk keeps its record batch message as the slot's IPC stream holds it (a view of the
WAL page cache or of the held payload, ``Stream.messages``), and the finalizer copies
those bytes into the segment's IPC file (``ipc_slices.file_pieces``): no decode, no
second encode. Streams with dictionaries are decoded and unified as before.

The ingest path adds one commit batch at a time (``add_batch``): stream extension,
counters and the schema checks (solo stream, schema variant) run once per
``(slot, fingerprint)`` group of the batch and once per schema object; per bundle
only its manifest entry and chunk refs are built. The result is the same as
``add(b, from_wal=True)`` bundle by bundle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from quiverd.kernel.bundle import META_SLOT, Buffer, Bundle, Slot, TxnTag
from quiverd.kernel.jobs import END_OFFSET, read_end_marker
from quiverd.segments.dictionaries import has_dictionary, needs_solo_stream
from quiverd.segments.ipc_slices import stream_messages
from quiverd.segments.table import StagedRef


@dataclass(slots=True)
class Stream:
    """Accumulator for one (slot, fingerprint): decoded batches, zero copy."""

    slot: int
    fingerprint: bytes
    schemas: list[pa.Schema] = field(default_factory=list)
    schema_index: dict[bytes, int] = field(default_factory=dict)
    batches: list[pa.RecordBatch] = field(default_factory=list)
    rows: int = 0
    min_ts: int | None = None
    max_ts: int | None = None
    # Per chunk, beside ``batches``: its record batch message as stored (a view of the
    # slot's IPC stream), for streams whose schema has no dictionary (``copyable``);
    # the segment copies these bytes. None where the chunk is known only decoded.
    messages: list[memoryview | None] = field(default_factory=list)
    copyable: bool | None = None  # set by the first schema: no dictionary anywhere

    def extend(
        self, stream_id: int, schema: pa.Schema, batches: list[pa.RecordBatch | None],
        ts: int, rows: int, messages: tuple[memoryview, ...] | None = None,
    ) -> list[ChunkRef]:
        """Append one bundle's batches (None: a batch still in the WAL, filled by
        ``OpenSegment.load``); returns their manifest refs. ``messages``: the same
        batches as record batch messages (``copyable`` streams)."""
        variant = self.variant(schema)
        first = len(self.batches)
        self.batches.extend(batches)  # None for batches still in the WAL
        self.messages.extend(messages if messages is not None else [None] * len(batches))
        self.rows += rows
        self.min_ts = ts if self.min_ts is None else min(self.min_ts, ts)
        self.max_ts = ts if self.max_ts is None else max(self.max_ts, ts)
        return [ChunkRef(self.slot, stream_id, first + k, variant) for k in range(len(batches))]

    def variant(self, schema: pa.Schema) -> int:
        """Index of ``schema`` (metadata included) among this stream's originals."""
        if self.schemas and self.schemas[-1].equals(schema, check_metadata=True):
            return len(self.schemas) - 1
        key = schema.serialize().to_pybytes()
        found = self.schema_index.get(key)
        if found is None:
            if self.schemas and not self.schemas[0].equals(schema):
                raise ValueError(f"slot {self.slot}: fingerprint does not match the schema")
            found = self.schema_index[key] = len(self.schemas)
            self.schemas.append(schema)
            if self.copyable is None:
                self.copyable = not any(has_dictionary(f.type) for f in schema)
        return found

    def decode_stored(self) -> None:
        """Decode the chunks known only as stored messages (a stream some of whose
        slots could not be cut, so it is encoded from batches after all)."""
        for k, batch in enumerate(self.batches):
            if batch is None and self.messages[k] is not None:
                self.batches[k] = pa.ipc.read_record_batch(pa.py_buffer(self.messages[k]),
                                                           self.schemas[0])

    def stored_messages(self) -> list[memoryview] | None:
        """Every chunk's record batch message, if the stream is copied as stored."""
        if not self.copyable or None in self.messages:
            return None
        return self.messages  # type: ignore[return-value]  # no None: checked


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One manifest slot_ref: chunk ``chunk`` of stream ``stream`` holds (part of)
    slot ``slot``; ``variant`` indexes the stream's original schemas."""

    slot: int
    stream: int
    chunk: int
    variant: int


@dataclass(frozen=True, slots=True)
class BundleEntry:
    """One manifest row as held in memory. ``in_wal``: ``add`` left its batches in WAL
    entry ``sequence`` (``OpenSegment.load`` reads them back)."""

    client: str
    ingestion_ts_ns: int
    sequence: int
    txn: TxnTag | None
    refs: tuple[ChunkRef, ...]
    in_wal: bool = False


SOLO_CACHE_SCHEMAS = 256  # schema objects whose needs_solo_stream answer is kept

# sequence -> {slot id: that slot's IPC stream bytes}, read back from the WAL.
Fetch = Callable[[list[int]], dict[int, dict[int, Buffer]]]


class OpenSegment:
    """In-memory accumulator of one shard's open segment (segment_builder actor).

    Holds decoded batches, not copies: each bundle's IPC payload buffer stays
    alive through the batches that view it. ``bytes`` counts payload bytes held.
    """

    def __init__(self) -> None:
        self._streams: list[Stream] = []
        self._by_key: dict[tuple[int, bytes], int] = {}
        self.entries: list[BundleEntry] = []
        self.bytes = 0
        self.first_sequence: int | None = None
        self.last_sequence: int | None = None
        self.min_ts: int | None = None
        self.max_ts: int | None = None
        self.unloaded = 0  # bundles whose batches are still only in the WAL
        # id(schema) -> (schema, needs_solo_stream): ingest hands the same schema object
        # bundle after bundle (its SchemaCache); the schema is held so the id stays its own.
        self._solo: dict[int, tuple[pa.Schema, bool]] = {}

    @property
    def bundle_count(self) -> int:
        return len(self.entries)

    @property
    def stream_count(self) -> int:
        return len(self._streams)

    @property
    def streams(self) -> list[Stream]:
        return self._streams

    def add(self, bundle: Bundle, *, from_wal: bool = False) -> None:
        """Append one bundle (ingestion_ts_ns and sequence set, user slots only).

        ``from_wal``: the bundle is durable in the WAL under its sequence; if every
        slot carries its validation facts (schema, batch count) the payloads are not
        held, ``load`` reads them back. End markers (tiny) are always held.
        """
        ts, seq = bundle.ingestion_ts_ns, bundle.sequence
        lazy = (from_wal and all(s.schema is not None for s in bundle.slots)
                and not (bundle.txn is not None and bundle.txn.row_offset == END_OFFSET))
        # Decode every slot before touching any stream, so a payload Arrow
        # rejects (ArrowInvalid) leaves this segment exactly as it was.
        decoded = [(slot, *(_facts(slot) if lazy else _decode(slot.ipc)))
                   for slot in bundle.slots]
        refs: list[ChunkRef] = []
        for slot, schema, batches in decoded:
            assert slot.slot < META_SLOT, "metadata slot must be split off before a segment"
            refs.extend(self._append(slot.slot, slot.fingerprint, schema, batches, ts,
                                     slot.row_count, None if lazy else slot.ipc))
        self.entries.append(BundleEntry(
            client=bundle.client, ingestion_ts_ns=ts, sequence=seq, txn=bundle.txn,
            refs=tuple(refs), in_wal=lazy,
        ))
        self.unloaded += lazy
        self.bytes += bundle.payload_bytes
        if self.first_sequence is None:
            self.first_sequence = seq
        self.last_sequence = seq
        self.min_ts = ts if self.min_ts is None else min(self.min_ts, ts)
        self.max_ts = ts if self.max_ts is None else max(self.max_ts, ts)

    def add_batch(self, bundles: Sequence[Bundle], *, decode: bool = True) -> int:
        """Append bundles in order, as ``add(b, from_wal=True)`` would one by one;
        returns how many were added.

        A bundle whose slots all carry their validation facts (and need no solo
        stream, and is no end marker) costs one manifest entry; runs of such bundles
        extend the streams once per group. Others go through ``add``. With
        ``decode=False`` the batch stops before the first bundle whose payload would
        have to be decoded (the caller adds the rest in a worker thread).
        """
        start = 0
        for i, bundle in enumerate(bundles):
            if self._plain(bundle):
                continue
            if i > start:
                self._add_plain(bundles[start:i])
            if not decode and any(s.schema is None for s in bundle.slots):
                return i
            self.add(bundle, from_wal=True)
            start = i + 1
        if len(bundles) > start:
            self._add_plain(bundles[start:])
        return len(bundles)

    def _plain(self, bundle: Bundle) -> bool:
        """Can ``bundle`` be added from its validation facts alone, in a plain stream?"""
        if bundle.txn is not None and bundle.txn.row_offset == END_OFFSET:
            return False  # end markers are held: staged() reads their rows
        solo = self._solo
        for slot in bundle.slots:
            schema = slot.schema
            if schema is None:
                return False
            known = solo.get(id(schema))
            if known is None:
                if len(solo) >= SOLO_CACHE_SCHEMAS:
                    solo.clear()  # schemas not shared between bundles: stay bounded
                known = solo[id(schema)] = (schema, needs_solo_stream(schema))
            if known[1]:
                return False
        return True

    def _add_plain(self, bundles: Sequence[Bundle]) -> None:
        """``bundles`` all ``_plain``: per bundle only its entry and refs are made."""
        groups: dict[tuple[int, bytes], _Group] = {}
        entries = self.entries
        first = len(entries)
        nbytes = 0
        try:
            for bundle in bundles:
                ts = bundle.ingestion_ts_ns
                refs: list[ChunkRef] = []
                size = 0
                for slot in bundle.slots:
                    assert slot.slot < META_SLOT, "metadata slot must be split off first"
                    group = groups.get((slot.slot, slot.fingerprint))
                    if group is None or group.schema is not slot.schema:
                        group = self._group(groups, slot)
                    refs.extend(group.take(max(slot.batches, 1), slot.row_count, ts))
                    size += len(slot.ipc)
                entries.append(BundleEntry(client=bundle.client, ingestion_ts_ns=ts,
                                           sequence=bundle.sequence, txn=bundle.txn,
                                           refs=tuple(refs), in_wal=True))
                nbytes += size
        finally:
            # Also when a schema check raised: what the entries refer to is settled.
            for group in groups.values():
                group.settle()
            self._count(bundles[:len(entries) - first], nbytes)

    def _count(self, bundles: Sequence[Bundle], nbytes: int) -> None:
        """The segment's counters after ``bundles`` (``nbytes`` of payload) were added."""
        if not bundles:
            return
        self.unloaded += len(bundles)
        self.bytes += nbytes
        if self.first_sequence is None:
            self.first_sequence = bundles[0].sequence
        self.last_sequence = bundles[-1].sequence
        lo = min(b.ingestion_ts_ns for b in bundles)
        hi = max(b.ingestion_ts_ns for b in bundles)
        self.min_ts = lo if self.min_ts is None else min(self.min_ts, lo)
        self.max_ts = hi if self.max_ts is None else max(self.max_ts, hi)

    def _group(self, groups: dict[tuple[int, bytes], _Group], slot: Slot) -> _Group:
        """The group of ``slot``'s stream for its schema object; a group of the same
        stream with another schema object is settled first, so chunks stay in order."""
        key = (slot.slot, slot.fingerprint)
        old = groups.get(key)
        if old is not None:
            old.settle()
        found = self._by_key.get(key)
        if found is None:
            found = self._by_key[key] = self._new_stream(slot.slot, slot.fingerprint)
        stream = self._streams[found]
        assert slot.schema is not None
        group = groups[key] = _Group(stream, found, slot.schema, stream.variant(slot.schema))
        return group

    def staged(self) -> dict[int, StagedRef]:
        """The transactional bundles by index, end markers with their rows and checksum."""
        out: dict[int, StagedRef] = {}
        for i, e in enumerate(self.entries):
            if e.txn is None:
                continue
            end = (-1, 0)
            if e.txn.row_offset == END_OFFSET and e.refs:
                ref = e.refs[0]
                end = read_end_marker(pa.Table.from_batches(
                    [self._streams[ref.stream].batches[ref.chunk]]))
            out[i] = StagedRef(job_id=e.txn.job_id, partition=e.txn.partition,
                               attempt=e.txn.attempt, end_rows=end[0], end_checksum=end[1])
        return out

    def _append(
        self, slot: int, fp: bytes, schema: pa.Schema, batches: list[pa.RecordBatch | None],
        ts: int, rows: int, payload: Buffer | None = None,
    ) -> list[ChunkRef]:
        """``payload``: the held slot's IPC stream (its batches decoded), whose record
        batch messages a stream without dictionaries keeps to copy them at finalize."""
        messages = None
        if needs_solo_stream(schema):
            groups = [[b] for b in batches]
            ids = [self._new_stream(slot, fp) for _ in batches]
            if all(b is not None for b in batches):
                counts = [b.num_rows for b in batches]  # type: ignore[union-attr]
            else:  # per-batch rows come with load(); the stream total is what counts
                counts = [rows] + [0] * (len(batches) - 1)
        else:
            found = self._by_key.get((slot, fp))
            if found is None:
                found = self._by_key[(slot, fp)] = self._new_stream(slot, fp)
            groups, ids, counts = [batches], [found], [rows]
            if payload is not None:
                cut = stream_messages(memoryview(payload))
                if cut is not None and len(cut.batches) == len(batches):
                    messages = cut.batches
        refs: list[ChunkRef] = []
        for stream_id, group, n in zip(ids, groups, counts, strict=True):
            refs.extend(self._streams[stream_id].extend(stream_id, schema, group, ts, n,
                                                        messages))
        return refs

    def load(self, fetch: Fetch) -> None:
        """Fill in the batches of bundles added ``from_wal`` (worker thread).

        ``fetch`` reads WAL entries back by sequence. A slot of a stream without
        dictionaries is cut into its record batch messages (views of the returned
        bytes, not decoded: ``Stream.messages``); any other slot's stream is decoded
        zero copy over them. Either way its chunks go exactly where ``add`` numbered
        them. A payload that no longer matches what ingest validated (batch count)
        raises ValueError: the WAL was damaged in between. Afterwards every stream is
        either copied whole (``stored_messages``) or decoded whole.
        """
        if not self.unloaded:
            return
        wanted = [e.sequence for e in self.entries if e.in_wal]
        payloads = fetch(wanted)
        streams = self._streams
        for e in self.entries:
            if not e.in_wal:
                continue
            slots = payloads.get(e.sequence)
            if slots is None:
                raise ValueError(f"WAL entry {e.sequence} could not be read back")
            # add() gave each slot's batches consecutive refs, slots ascending.
            refs, i = e.refs, 0
            while i < len(refs):
                slot_id, j = refs[i].slot, i + 1
                while j < len(refs) and refs[j].slot == slot_id:
                    j += 1
                if slot_id not in slots:
                    raise ValueError(f"WAL entry {e.sequence} has no slot {slot_id}")
                payload = slots[slot_id]
                cut = (stream_messages(memoryview(payload)) if streams[refs[i].stream].copyable
                       else None)
                if cut is not None:
                    _check_count(e.sequence, slot_id, len(cut.batches), j - i)
                    for ref, message in zip(refs[i:j], cut.batches, strict=True):
                        streams[ref.stream].messages[ref.chunk] = message
                else:
                    _, batches = _decode(payload)
                    _check_count(e.sequence, slot_id, len(batches), j - i)
                    for ref, batch in zip(refs[i:j], batches, strict=True):
                        streams[ref.stream].batches[ref.chunk] = batch
                i = j
        self.unloaded = 0  # in_wal stays on the entries: it is only read by load()
        for stream in self._streams:
            if stream.stored_messages() is not None:
                continue  # copied as stored: its rows are the validated counts
            stream.decode_stored()
            # Solo streams learn their per-batch rows only now.
            stream.rows = sum(b.num_rows for b in stream.batches)

    def drop_batches(self) -> None:
        """Let go of every batch (after the segment is durable): they may map WAL
        regions that are about to be released."""
        for stream in self._streams:
            stream.batches = []
            stream.messages = []

    def _new_stream(self, slot: int, fp: bytes) -> int:
        self._streams.append(Stream(slot, fp))
        return len(self._streams) - 1


class _Group:
    """One stream's share of a run of plain bundles with one schema object: chunks
    are numbered as they come, the stream is extended once (``settle``)."""

    __slots__ = ("stream", "stream_id", "schema", "variant", "base", "count", "rows",
                 "min_ts", "max_ts")

    def __init__(self, stream: Stream, stream_id: int, schema: pa.Schema, variant: int) -> None:
        self.stream, self.stream_id, self.schema, self.variant = stream, stream_id, schema, variant
        self.base = len(stream.batches)
        self.count = self.rows = 0
        self.min_ts = self.max_ts = 0  # of the chunks taken since the last settle

    def take(self, n: int, rows: int, ts: int) -> list[ChunkRef]:
        """Refs for one slot's ``n`` chunks (in the WAL, filled by ``load``)."""
        first = self.base + self.count
        if not self.count:
            self.min_ts = self.max_ts = ts
        elif ts < self.min_ts:
            self.min_ts = ts
        if ts > self.max_ts:
            self.max_ts = ts
        self.count += n
        self.rows += rows
        slot, stream_id, variant = self.stream.slot, self.stream_id, self.variant
        return [ChunkRef(slot, stream_id, first + k, variant) for k in range(n)]

    def settle(self) -> None:
        """Extend the stream by the chunks taken (idempotent)."""
        if not self.count:
            return
        s = self.stream
        s.batches.extend([None] * self.count)  # load() fills them
        s.messages.extend([None] * self.count)
        s.rows += self.rows
        s.min_ts = self.min_ts if s.min_ts is None else min(s.min_ts, self.min_ts)
        s.max_ts = self.max_ts if s.max_ts is None else max(s.max_ts, self.max_ts)
        self.base += self.count
        self.count = self.rows = 0


def _check_count(sequence: int, slot: int, found: int, validated: int) -> None:
    if found != validated:
        raise ValueError(f"WAL entry {sequence} slot {slot}: {found} batches read back, "
                         f"{validated} validated at ingest")


def _facts(slot: Slot) -> tuple[pa.Schema, list[pa.RecordBatch | None]]:
    """What ingest validation found, as ``_decode`` would give it, batches left in the WAL."""
    assert slot.schema is not None
    return slot.schema, [None] * max(slot.batches, 1)


def _decode(payload: Buffer) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """Zero-copy decode of one slot's IPC stream; an empty stream becomes one
    0-row chunk so the slot stays present (it reads back as a 0-row table)."""
    with pa.ipc.open_stream(pa.py_buffer(payload)) as reader:
        schema = reader.schema
        batches = list(reader)
    return schema, batches or [pa.RecordBatch.from_pylist([], schema=schema)]
