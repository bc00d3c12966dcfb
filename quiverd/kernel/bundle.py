"""RecordBundle: the unit of ingest, and the helpers every layer shares.

A bundle is a fixed table of up to 64 optional slots; a present slot holds one
Arrow IPC *stream* (schema + batches + EOS) exactly as the producer sent it.
Bundle metadata that has no fixed WAL field (client name, transactional tag,
producer tag) travels in the reserved slot ``META_SLOT`` (SPEC §3 allows "a reserved slot"),
so the producer's slot payloads are stored byte for byte, untouched:

    slot 0..62   producer data          payload_type_id = slot id
    slot 63      bundle metadata        payload_type_id = 0xFFFF
                 one-row IPC stream: client utf8, job_id utf8?, partition u32?,
                 attempt u32?, row_offset u64?, and for a numbered producer's bundle
                 also producer utf8, incarnation u64, producer_seq u64
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import msgspec
import pyarrow as pa

from quiverd.kernel import flatbuf
from quiverd.kernel.names import reserved_column_problem
from quiverd.kernel.producers import ProducerTag

Buffer = bytes | bytearray | memoryview

MAX_SLOTS = 64
META_SLOT = MAX_SLOTS - 1
USER_SLOTS = META_SLOT  # producers may use slots 0..62
META_PAYLOAD_TYPE = 0xFFFF
FINGERPRINT_LEN = 32
MAX_CLIENT_LEN = 255

META_SCHEMA = pa.schema(
    [
        pa.field("client", pa.utf8(), nullable=False),
        pa.field("job_id", pa.utf8()),
        pa.field("partition", pa.uint32()),
        pa.field("attempt", pa.uint32()),
        pa.field("row_offset", pa.uint64()),
    ]
)
# A numbered producer's bundle (protocol v3): the same, and its stream and number.
PRODUCER_META_SCHEMA = pa.schema([
    *META_SCHEMA,
    pa.field("producer", pa.utf8(), nullable=False),
    pa.field("incarnation", pa.uint64(), nullable=False),
    pa.field("producer_seq", pa.uint64(), nullable=False),
])


class TxnTag(msgspec.Struct, frozen=True, kw_only=True):
    """SPEC §7 transactional tag: which Spark task attempt wrote these rows."""

    job_id: str
    partition: int
    attempt: int
    row_offset: int


class Slot(msgspec.Struct, frozen=True, kw_only=True):
    """One present slot: its IPC stream bytes and what the WAL records about them."""

    slot: int
    fingerprint: bytes
    row_count: int
    ipc: Buffer
    payload_type_id: int = -1  # -1: the slot id itself
    # Filled by ingest validation (the one decode on the way in): the stream's schema
    # (metadata included) and how many record batches it holds. The open segment
    # needs only these, so it need not keep the payload (it is read back from the
    # WAL at finalize). None/0: unknown, the open segment decodes the payload itself.
    schema: pa.Schema | None = None
    batches: int = 0

    @property
    def type_id(self) -> int:
        return self.slot if self.payload_type_id < 0 else self.payload_type_id


class Bundle(msgspec.Struct, frozen=True, kw_only=True):
    """A bundle as the daemon holds it: user slots only (never META_SLOT)."""

    client: str
    slots: tuple[Slot, ...]
    txn: TxnTag | None = None
    ingestion_ts_ns: int = 0
    sequence: int = 0
    producer: ProducerTag | None = None  # a numbered producer's (never with txn)

    @property
    def row_count(self) -> int:
        return sum(s.row_count for s in self.slots)

    @property
    def payload_bytes(self) -> int:
        return sum(len(s.ipc) for s in self.slots)

    def tables(self) -> dict[int, pa.Table]:
        """Decode every slot (zero copy over the payload buffers)."""
        return {s.slot: read_ipc_stream(s.ipc) for s in self.slots}


def fingerprint(schema: pa.Schema) -> bytes:
    """32-byte SHA-256 of the canonical schema: names, types, nullability, order.

    Schema- and field-level metadata are left out: they do not change how a
    column is laid out, so they must not split a stream.
    """
    canonical = pa.schema([f.remove_metadata() for f in schema])
    return hashlib.sha256(canonical.serialize().to_pybytes()).digest()


def read_ipc_stream(payload: Buffer) -> pa.Table:
    """Decode one IPC stream; raises ``pa.ArrowInvalid`` on malformed bytes."""
    with pa.ipc.open_stream(pa.py_buffer(payload)) as reader:
        return reader.read_all()


class StreamFacts(msgspec.Struct, frozen=True):
    """What validating one slot's IPC stream found."""

    fingerprint: bytes
    rows: int
    schema: pa.Schema
    batches: int  # record batches in the stream (0 for an empty stream)


def inspect_ipc_stream(payload: Buffer) -> StreamFacts:
    """Validate an IPC stream fully; return its fingerprint, rows, schema and batch count.

    Raises ``pa.ArrowInvalid``/``OSError``/``ValueError`` for anything Arrow
    rejects, including data buffers that do not match their declared lengths, and
    ``ValueError`` for compressed bodies (see ``reject_compressed_bodies``).
    """
    reject_compressed_bodies(payload)
    with pa.ipc.open_stream(pa.py_buffer(payload)) as reader:
        schema = reader.schema
        batches = list(reader)
    check_field_names(schema)
    rows = 0
    for batch in batches:
        batch.validate(full=True)
        rows += batch.num_rows
    return StreamFacts(fingerprint(schema), rows, schema, len(batches))


class ReservedColumnName(ValueError):
    """A top-level column name uses the prefix quiverd keeps for its own columns."""


def check_field_names(schema: pa.Schema) -> None:
    """Raise ValueError unless every field name, nested ones included, is UTF-8, and
    ReservedColumnName if a top-level one starts with ``_quiver_``.

    Arrow requires UTF-8 names, but the IPC reader takes any bytes; pyarrow then fails
    only when a name is first read as a Python string, which would be at finalize,
    after the bundle was acknowledged. A ``_quiver_`` column would collide with the
    columns the lake adds to every row (SPEC §1): refused here, before the ACK, rather
    than found by the uploader, which could then never finish the bundle.
    """
    pending = list(schema)
    while pending:
        field = pending.pop()
        try:
            field.name  # noqa: B018 - decoding the name is the check
        except UnicodeDecodeError as exc:
            raise ValueError(f"a field name is not valid UTF-8 ({exc.reason} at byte "
                             f"{exc.start})") from None
        typ = field.type
        if pa.types.is_dictionary(typ):
            typ = typ.value_type
        pending.extend(typ.field(i) for i in range(typ.num_fields))
    problem = reserved_column_problem(schema.names)
    if problem is not None:
        raise ReservedColumnName(problem)


def stream_facts(payload: Buffer) -> tuple[pa.Schema, int]:
    """Schema and record-batch count of an IPC stream already validated once (WAL
    replay): batches are opened zero copy, not validated again."""
    with pa.ipc.open_stream(pa.py_buffer(payload)) as reader:
        return reader.schema, sum(1 for _ in reader)


def reject_compressed_bodies(payload: Buffer) -> None:
    """Raise ValueError if a record or dictionary batch of the stream is compressed.

    Decompressing allocates what the batch's metadata declares, not what was sent:
    12 KiB of zstd decode to 400 MB. Payload bytes bound the daemon's memory only
    while bodies are stored as sent, so compressed (LZ4/ZSTD) bodies are refused
    before anything is decoded. Reading messages slices bodies without copying.
    """
    for message in pa.ipc.MessageReader.open_stream(pa.py_buffer(payload)):
        if message.type in ("record batch", "dictionary") and _body_compressed(
                memoryview(message.metadata)):
            raise ValueError("compressed IPC bodies (LZ4/ZSTD) are not accepted; write "
                             "the stream without compression")


# Arrow's Message.fbs, as flatbuffer field indexes: Message{version, header_type,
# header, bodyLength, custom_metadata}, DictionaryBatch{id, data, isDelta},
# RecordBatch{length, nodes, buffers, compression, variadicBufferCounts}.
_HEADER_TYPE, _HEADER, _BODY_LENGTH = 1, 2, 3
_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3
_DICTIONARY_DATA = 1
_BATCH_COMPRESSION = 3


def _body_compressed(meta: memoryview) -> bool:
    root = flatbuf.table_at(meta, 0)
    kind_at = flatbuf.field(meta, root, _HEADER_TYPE)
    kind = flatbuf.read(meta, "<B", kind_at) if kind_at is not None else 0
    batch = flatbuf.table_field(meta, root, _HEADER)
    if kind == _DICTIONARY_BATCH and batch is not None:
        batch = flatbuf.table_field(meta, batch, _DICTIONARY_DATA)
    if kind not in (_DICTIONARY_BATCH, _RECORD_BATCH) or batch is None:
        return False
    return flatbuf.field(meta, batch, _BATCH_COMPRESSION) is not None










def encode_ipc_stream(data: pa.Table | pa.RecordBatch) -> bytes:
    """One IPC stream holding ``data`` (schema + batches + EOS)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, data.schema) as writer:
        writer.write(data)
    return sink.getvalue().to_pybytes()


def make_slot(slot: int, data: pa.Table | pa.RecordBatch) -> Slot:
    """Encode ``data`` as slot ``slot`` (client-side helper and tests)."""
    return Slot(
        slot=slot, fingerprint=fingerprint(data.schema), row_count=data.num_rows,
        ipc=encode_ipc_stream(data),
    )


class MetaCodec:
    """Encodes/decodes the META_SLOT payload; caches the common no-tag case.

    The cache is bounded (LRU of ``capacity`` clients), per instance, so one
    shard's codec holds at most ``capacity`` small payloads.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._capacity = capacity
        self._cache: OrderedDict[str, Slot] = OrderedDict()

    def encode(self, client: str, txn: TxnTag | None,
               producer: ProducerTag | None = None) -> Slot:
        if txn is None and producer is None:
            hit = self._cache.get(client)
            if hit is not None:
                self._cache.move_to_end(client)
                return hit
        columns = [
            pa.array([client], pa.utf8()),
            pa.array([txn.job_id if txn else None], pa.utf8()),
            pa.array([txn.partition if txn else None], pa.uint32()),
            pa.array([txn.attempt if txn else None], pa.uint32()),
            pa.array([txn.row_offset if txn else None], pa.uint64()),
        ]
        schema, fp = META_SCHEMA, META_FINGERPRINT
        if producer is not None:
            columns += [pa.array([producer.producer], pa.utf8()),
                        pa.array([producer.incarnation], pa.uint64()),
                        pa.array([producer.seq], pa.uint64())]
            schema, fp = PRODUCER_META_SCHEMA, PRODUCER_META_FINGERPRINT
        slot = Slot(
            slot=META_SLOT, fingerprint=fp, row_count=1,
            ipc=encode_ipc_stream(pa.record_batch(columns, schema=schema)),
            payload_type_id=META_PAYLOAD_TYPE,
        )
        if txn is None and producer is None:
            self._cache[client] = slot
            if len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return slot

    @staticmethod
    def decode(payload: Buffer) -> tuple[str, TxnTag | None, ProducerTag | None]:
        table = read_ipc_stream(payload)
        if table.num_rows != 1 or table.schema.names[:1] != ["client"]:
            raise ValueError("metadata slot must hold one row starting with 'client'")
        row = table.to_pylist()[0]
        txn = producer = None
        if row.get("job_id") is not None:
            txn = TxnTag(
                job_id=row["job_id"], partition=row["partition"],
                attempt=row["attempt"], row_offset=row["row_offset"],
            )
        if row.get("producer") is not None:
            producer = ProducerTag(producer=row["producer"], incarnation=row["incarnation"],
                                   seq=row["producer_seq"])
        return row["client"], txn, producer


META_FINGERPRINT = fingerprint(META_SCHEMA)
PRODUCER_META_FINGERPRINT = fingerprint(PRODUCER_META_SCHEMA)


def split_meta(slots: list[Slot] | tuple[Slot, ...]
               ) -> tuple[str, TxnTag | None, ProducerTag | None, tuple[Slot, ...]]:
    """Separate META_SLOT from user slots (as read back from the WAL)."""
    client, txn, producer = "", None, None
    user: list[Slot] = []
    for s in slots:
        if s.slot == META_SLOT:
            client, txn, producer = MetaCodec.decode(s.ipc)
        else:
            user.append(s)
    return client, txn, producer, tuple(user)
