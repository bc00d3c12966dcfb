"""Validating ingested IPC streams with the schema-only checks done once per schema.

``inspect_ipc_stream`` (``quiverd.kernel.bundle``) checks everything for every stream;
``SchemaCache.inspect`` gives the same facts and the same errors, but keeps what depends
only on a schema (field names, fingerprint) by the schema message's bytes, and reads
each record batch's compression flag from its message by hand before anything is
decoded (a compressed stream has the same schema bytes as a plain one).
"""

from __future__ import annotations

import struct

import pyarrow as pa

from quiverd.kernel.bundle import (
    _BATCH_COMPRESSION,
    _BODY_LENGTH,
    _HEADER,
    _HEADER_TYPE,
    _RECORD_BATCH,
    _SCHEMA,
    Buffer,
    StreamFacts,
    inspect_ipc_stream,
)


class SchemaCache:
    """``inspect_ipc_stream`` with the schema-only checks done once per schema.

    Field names (UTF-8, the ``_quiver_`` prefix) and the fingerprint depend only on
    the schema, and a producer sends the same schema bundle after bundle: they are
    kept by the schema message's bytes (which fix the schema, metadata included).
    What depends on each bundle's bytes is still checked every time: compressed
    bodies, decoding, ``validate(full=True)``, row counts. A failed check is not
    kept. At most ``capacity`` schemas are held (oldest dropped first).
    """

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._known: dict[bytes, tuple[pa.Schema, bytes]] = {}

    def __len__(self) -> int:
        return len(self._known)

    def inspect(self, payload: Buffer) -> StreamFacts:
        """Like ``inspect_ipc_stream`` (same errors), with the schema checks cached.

        One pass over the stream's messages: the schema message is looked up by its
        bytes, each record batch's compression flag is read from its metadata before
        the batch is decoded. A stream with dictionary batches, or anything this pass
        does not expect, goes through ``inspect_ipc_stream`` instead (which also gives
        bad input its usual error).
        """
        try:
            facts = self._one_pass(payload)
        except (pa.ArrowException, OSError, ValueError, StopIteration):
            facts = None
        if facts is None:
            facts = inspect_ipc_stream(payload)
            self._remember(_schema_message(payload), facts.schema, facts.fingerprint)
        return facts

    def _one_pass(self, payload: Buffer) -> StreamFacts | None:
        walked = _walk_messages(payload)
        if walked is None:
            return None
        known = self._known.get(walked)
        if known is None:
            return None  # first sight: the full path checks and remembers it
        schema, rows, count = known[0], 0, 0
        with pa.ipc.open_stream(pa.py_buffer(payload)) as reader:
            for batch in reader:
                batch.validate(full=True)
                rows += batch.num_rows
                count += 1
        return StreamFacts(known[1], rows, schema, count)

    def _remember(self, key: bytes, schema: pa.Schema, fp: bytes) -> None:
        if key in self._known:
            return
        if len(self._known) >= self.capacity:  # (a worker thread may evict at once too)
            self._known.pop(next(iter(self._known), b""), None)
        self._known[key] = (schema, fp)


_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_I64 = struct.Struct("<q")
_CONTINUATION = 0xFFFFFFFF


def _walk_messages(payload: Buffer) -> bytes | None:
    """The schema message's bytes if the stream is a schema followed only by record
    batches with uncompressed bodies, then end of stream; else None (not judged here).

    Reads each message's framing and the few flatbuffer fields that matter by hand,
    so nothing is decoded or copied before the compression check. Every offset is
    bounds checked (a negative one would read from the end); any doubt returns None.
    """
    view = memoryview(payload).cast("B")
    end, pos, key = len(view), 0, None
    try:
        while pos + 8 <= end:
            (length,) = _I32.unpack_from(view, pos)
            if length == -1:  # continuation marker, then the length
                (length,) = _I32.unpack_from(view, pos + 4)
                pos += 4
            if length == 0:
                return key if pos + 4 == end else None  # end of stream: nothing after
            meta = view[pos + 4:pos + 4 + length]
            if length < 0 or len(meta) != length:
                return None
            facts = _message_facts(meta)
            if facts is None:
                return None
            kind, body, compressed = facts
            if key is None:
                if kind != _SCHEMA:
                    return None
                key = bytes(meta)
            elif kind != _RECORD_BATCH or compressed:
                return None
            pos += 4 + length + body
        return None
    except (struct.error, IndexError):
        return None


def _message_facts(meta: memoryview) -> tuple[int, int, bool] | None:
    """(header type, body length, compressed) of one IPC message's flatbuffer."""
    root = _table(meta, _I32.unpack_from(meta, 0)[0])
    if root is None:
        return None
    table, vtable, vlen = root
    kind_at = _slot(meta, vtable, vlen, _HEADER_TYPE)
    kind = meta[table + kind_at] if kind_at else 0
    body_at = _slot(meta, vtable, vlen, _BODY_LENGTH)
    body = _I64.unpack_from(meta, table + body_at)[0] if body_at else 0
    if body < 0 or (body_at and table + body_at + 8 > len(meta)):
        return None
    compressed = False
    if kind == _RECORD_BATCH:
        header_at = _slot(meta, vtable, vlen, _HEADER)
        if not header_at:
            return None
        ref = table + header_at
        batch = _table(meta, ref + _U32.unpack_from(meta, ref)[0])
        if batch is None:
            return None
        compressed = _slot(meta, batch[1], batch[2], _BATCH_COMPRESSION) != 0
    return kind, body, compressed


def _table(meta: memoryview, table: int) -> tuple[int, int, int] | None:
    """(table, vtable, vtable length) of the flatbuffer table at ``table``, checked."""
    n = len(meta)
    if not 0 <= table <= n - 4:
        return None
    vtable = table - _I32.unpack_from(meta, table)[0]
    if not 0 <= vtable <= n - 4:
        return None
    vlen = _U16.unpack_from(meta, vtable)[0]
    return (table, vtable, vlen) if vtable + vlen <= n else None


def _slot(meta: memoryview, vtable: int, vlen: int, index: int) -> int:
    """Offset of field ``index`` from its table (0: absent)."""
    at = 4 + 2 * index
    return _U16.unpack_from(meta, vtable + at)[0] if at + 2 <= vlen else 0


def _schema_message(payload: Buffer) -> bytes:
    """The first IPC message's metadata bytes (the schema), as a dictionary key.

    Only called once the stream opened, so the schema message is there; the 8-byte
    framing is continuation marker + length, or the pre-1.0 bare length.
    """
    view = memoryview(payload).cast("B")
    start = 8 if view[:4] == b"\xff\xff\xff\xff" else 4
    length = int.from_bytes(view[start - 4:start], "little")
    return bytes(view[start:start + length])
