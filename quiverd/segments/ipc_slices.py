"""Where the messages of an Arrow IPC file lie, read by hand (pure, no decode).

A segment stream is one Arrow IPC *file*; a subscriber wants an IPC *stream*.
Both carry the same encapsulated messages, so a stream is cut from a file by
concatenating byte slices, without decoding or re-encoding anything::

    IPC file                                   IPC stream (what a slot carries)
    b"ARROW1" + pad[2]                         schema message
    schema message                             dictionary messages
    dictionary / record batch messages  ─────▶ record batch messages
    footer flatbuffer                          EOS = u32 0xFFFFFFFF, i32 0
    i32 footer_len, b"ARROW1"

    message    = u32 0xFFFFFFFF, i32 meta_len, Message flatbuffer (meta_len bytes,
                 padded to 8), body (bodyLength bytes)
    Footer     = table {version i16, schema, dictionaries [Block], recordBatches [Block],
                 custom_metadata}
    Block      = struct {offset i64, metaDataLength i32, pad 4, bodyLength i64}
                 (BLOCK_LEN = 8 + 4 + 4 + 8 = 24 bytes; metaDataLength counts the
                 8-byte prefix and the padding)

Every offset and length read here is checked against the bytes given: a damaged
footer raises ``ValueError``, never an out-of-bounds slice.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from quiverd.kernel import flatbuf

FILE_MAGIC = b"ARROW1"
FILE_HEAD_LEN = 8  # magic (6) + pad (2)
FILE_TAIL_LEN = 4 + len(FILE_MAGIC)  # footer_len i32 + magic
CONTINUATION = 0xFFFFFFFF
EOS = struct.pack("<Ii", CONTINUATION, 0)
BLOCK = struct.Struct("<qi4xq")  # offset, metaDataLength, pad, bodyLength = 24 bytes
PREFIX = struct.Struct("<Ii")  # continuation, meta_len

# Flatbuffer field indexes (Arrow's File.fbs / Message.fbs).
_FOOTER_DICTIONARIES, _FOOTER_RECORD_BATCHES = 2, 3
_MESSAGE_HEADER_TYPE, _MESSAGE_HEADER = 1, 2
_HEADER_RECORD_BATCH = 3
_RECORD_BATCH_LENGTH = 0


@dataclass(frozen=True, slots=True)
class FileBlocks:
    """(offset, length) of every message of one IPC file, relative to its first byte;
    a length covers the message's metadata and body."""

    dictionaries: tuple[tuple[int, int], ...]
    batches: tuple[tuple[int, int], ...]


def file_blocks(data: memoryview) -> FileBlocks:
    """Parse an IPC file's footer: where its dictionary and record batch messages are."""
    size = len(data)
    if size < FILE_HEAD_LEN + FILE_TAIL_LEN or bytes(data[:6]) != FILE_MAGIC \
            or bytes(data[size - 6:]) != FILE_MAGIC:
        raise ValueError("not an Arrow IPC file (magic)")
    (footer_len,) = struct.unpack_from("<i", data, size - FILE_TAIL_LEN)
    footer_start = size - FILE_TAIL_LEN - footer_len
    if footer_len <= 0 or footer_start < FILE_HEAD_LEN:
        raise ValueError(f"IPC file footer length {footer_len} out of bounds")
    footer = data[footer_start: size - FILE_TAIL_LEN]
    root = flatbuf.table_at(footer, 0)
    return FileBlocks(
        dictionaries=_blocks(footer, root, _FOOTER_DICTIONARIES, data, footer_start),
        batches=_blocks(footer, root, _FOOTER_RECORD_BATCHES, data, footer_start),
    )


def batch_rows(message: memoryview) -> int:
    """Row count of one encapsulated record batch message (its ``length`` field)."""
    _, meta_len = PREFIX.unpack_from(message, 0)
    meta = message[PREFIX.size: PREFIX.size + meta_len]
    root = flatbuf.table_at(meta, 0)
    kind_at = flatbuf.field(meta, root, _MESSAGE_HEADER_TYPE)
    header_at = flatbuf.field(meta, root, _MESSAGE_HEADER)
    if kind_at is None or flatbuf.read(meta, "<B", kind_at) != _HEADER_RECORD_BATCH \
            or header_at is None:
        raise ValueError("IPC message is not a record batch")
    length_at = flatbuf.field(meta, flatbuf.table_at(meta, header_at), _RECORD_BATCH_LENGTH)
    rows = 0 if length_at is None else flatbuf.read(meta, "<q", length_at)
    if rows < 0:
        raise ValueError(f"record batch of {rows} rows")
    return rows


def _blocks(footer: memoryview, root: int, index: int, data: memoryview,
            end: int) -> tuple[tuple[int, int], ...]:
    """One vector of Blocks, each checked: inside the messages region, a message
    prefix at its offset whose metadata fits the block."""
    at = flatbuf.field(footer, root, index)
    if at is None:
        return ()
    vector = at + flatbuf.read(footer, "<I", at)
    count = flatbuf.read(footer, "<I", vector)
    if count < 0 or vector + 4 + count * BLOCK.size > len(footer):
        raise ValueError("IPC file footer: block vector out of bounds")
    out = []
    for k in range(count):
        offset, meta_len, body_len = BLOCK.unpack_from(footer, vector + 4 + k * BLOCK.size)
        length = meta_len + body_len
        if offset < FILE_HEAD_LEN or meta_len < PREFIX.size or body_len < 0 \
                or offset + length > end or offset % 8:
            raise ValueError(f"IPC file footer: block {k} at {offset}+{length} out of bounds")
        marker, flatbuffer_len = PREFIX.unpack_from(data, offset)
        if marker != CONTINUATION or not 0 < flatbuffer_len <= meta_len - PREFIX.size:
            raise ValueError(f"IPC file: no message at offset {offset}")
        out.append((offset, length))
    return tuple(out)







# ---- an IPC file built from the messages of IPC streams (finalize) -----------------------
# A stream whose schema holds no dictionary is a schema message, record batch messages and
# EOS; its record batch messages are copied into the segment's IPC file as they lie in the
# WAL, and only the file's head and footer are new bytes (quiverd.segments.format):
#
#     b"ARROW1" + pad[2]  schema message  batch message ...  EOS  Footer  i32 len  b"ARROW1"
#
#     Footer flatbuffer, written front to back (offsets point forward, as flatbuffers want):
#     0   u32 root = FOOTER_TABLE
#     4   vtable: u16 size = 12, u16 table size = 20, u16 field offsets
#                 version 16, schema 4, dictionaries 8, recordBatches 12
#     16  table: i32 soffset to the vtable (12), u32 schema, u32 dictionaries,
#                u32 recordBatches, i16 version, pad[2]
#     36  dictionaries: u32 count = 0
#     40  pad[4], then recordBatches: u32 count, Block[count] at 48 (8-aligned)
#     ..  the schema message's flatbuffer, copied whole (its offsets are relative, so the
#         Schema table inside it is valid where it lands); the footer's schema field
#         points at that Schema table

_MESSAGE_VERSION, _MESSAGE_BODY_LENGTH = 0, 3
_HEADER_SCHEMA = 1
_SCHEMA_ENDIANNESS = 0  # Schema{endianness, fields, custom_metadata, features}: 0 = Little
_BATCH_COMPRESSION = 3
FOOTER_TABLE = 16
_FOOTER_HEAD = struct.Struct("<I6H")  # root + vtable: 4 + 12 = 16 bytes
_FOOTER_FIELDS = struct.Struct("<iIIIh2x")  # the table: 4 + 4 + 4 + 4 + 2 + 2 = 20 bytes
_VECTORS_AT = FOOTER_TABLE + _FOOTER_FIELDS.size  # 36: dictionaries, then recordBatches
_BLOCKS_AT = _VECTORS_AT + 4 + 4 + 4  # 48: count 0, pad, count; Blocks 8-aligned
assert _FOOTER_HEAD.size == FOOTER_TABLE and _BLOCKS_AT % 8 == 0


@dataclass(frozen=True, slots=True)
class StreamMessages:
    """An IPC stream cut into its messages (views of the given bytes, no copy)."""

    schema: memoryview
    batches: tuple[memoryview, ...]  # each record batch message whole: prefix, metadata, body


def stream_messages(data: memoryview) -> StreamMessages | None:
    """The schema and record batch messages of one IPC stream, or None when the stream
    is not one a file can be built from by copying: a dictionary (or other) message, the
    pre-0.15 prefix without continuation marker, a message whose length is not a
    multiple of 8 (a file's blocks are 8-aligned), a compressed body, no record batch,
    or bytes that do not parse (the caller then decodes the stream, which says why)."""
    try:
        return _stream_messages(data)
    except (ValueError, struct.error):
        return None


def _stream_messages(data: memoryview) -> StreamMessages | None:
    size = len(data)
    pos = 0
    schema: memoryview | None = None
    batches: list[memoryview] = []
    while pos + PREFIX.size <= size:
        marker, meta_len = PREFIX.unpack_from(data, pos)
        if marker != CONTINUATION:
            return None
        if meta_len == 0:
            break  # EOS
        end_meta = pos + PREFIX.size + meta_len
        if meta_len < 0 or meta_len % 8 or end_meta > size:
            return None
        meta = data[pos + PREFIX.size: end_meta]
        root = flatbuf.table_at(meta, 0)
        kind_at = flatbuf.field(meta, root, _MESSAGE_HEADER_TYPE)
        kind = 0 if kind_at is None else flatbuf.read(meta, "<B", kind_at)
        body_at = flatbuf.field(meta, root, _MESSAGE_BODY_LENGTH)
        body = 0 if body_at is None else flatbuf.read(meta, "<q", body_at)
        end = end_meta + body
        if body < 0 or body % 8 or end > size:
            return None
        if schema is None:
            if kind != _HEADER_SCHEMA or body or _big_endian(meta, root):
                return None
            schema = data[pos:end]
        elif kind == _HEADER_RECORD_BATCH:
            header = flatbuf.table_field(meta, root, _MESSAGE_HEADER)
            if header is None or flatbuf.field(meta, header, _BATCH_COMPRESSION) is not None:
                return None
            batches.append(data[pos:end])
        else:
            return None  # a dictionary batch (or a tensor): not copied
        pos = end
    if schema is None or not batches:
        return None
    return StreamMessages(schema=schema, batches=tuple(batches))


def _big_endian(meta: memoryview, root: int) -> bool:
    """Does the schema message declare big-endian bodies? Arrow's reader swaps those to
    native order on decode; copied as stored under a little-endian file schema they
    would read as other values, so such a stream is decoded instead."""
    schema = flatbuf.table_field(meta, root, _MESSAGE_HEADER)
    at = None if schema is None else flatbuf.field(meta, schema, _SCHEMA_ENDIANNESS)
    return at is not None and flatbuf.read(meta, "<h", at) != 0


def file_pieces(schema_message: bytes | memoryview,
                batches: list[memoryview]) -> tuple[list[bytes | memoryview], int]:
    """An IPC file holding ``batches`` (whole record batch messages, as
    ``stream_messages`` cuts them) under ``schema_message``: the pieces to write in
    order, and their total size. Only the head and the footer are new bytes."""
    pieces: list[bytes | memoryview] = [FILE_MAGIC + b"\0\0", schema_message]
    offset = FILE_HEAD_LEN + len(schema_message)
    blocks = []
    for message in batches:
        _, meta_len = PREFIX.unpack_from(message, 0)
        length = len(message)
        blocks.append((offset, PREFIX.size + meta_len, length - PREFIX.size - meta_len))
        pieces.append(message)
        offset += length
    footer = file_footer(schema_message, blocks)
    tail = EOS + footer + struct.pack("<i", len(footer)) + FILE_MAGIC
    pieces.append(tail)
    return pieces, offset + len(tail)


def file_footer(schema_message: bytes | memoryview,
                blocks: list[tuple[int, int, int]]) -> bytes:
    """The IPC file Footer flatbuffer: no dictionaries, record batches at ``blocks``
    ((offset, metaDataLength, bodyLength) each), the schema of ``schema_message`` (an
    encapsulated Schema message) and its metadata version (layout above)."""
    marker, meta_len = PREFIX.unpack_from(schema_message, 0)
    meta = memoryview(schema_message)[PREFIX.size: PREFIX.size + meta_len]
    if marker != CONTINUATION or len(meta) != meta_len or meta_len % 8:
        raise ValueError("not an encapsulated schema message")
    root = flatbuf.table_at(meta, 0)
    kind_at = flatbuf.field(meta, root, _MESSAGE_HEADER_TYPE)
    schema_at = flatbuf.table_field(meta, root, _MESSAGE_HEADER)
    if kind_at is None or flatbuf.read(meta, "<B", kind_at) != _HEADER_SCHEMA or schema_at is None:
        raise ValueError("not a schema message")
    version_at = flatbuf.field(meta, root, _MESSAGE_VERSION)
    version = 0 if version_at is None else flatbuf.read(meta, "<h", version_at)
    embedded = _BLOCKS_AT + BLOCK.size * len(blocks)  # 8-aligned: the meta's own alignment
    fields_at = FOOTER_TABLE + 4  # schema, dictionaries, recordBatches: u32 each
    out = bytearray(_FOOTER_HEAD.pack(FOOTER_TABLE, 12, _FOOTER_FIELDS.size, 16, 4, 8, 12))
    out += _FOOTER_FIELDS.pack(FOOTER_TABLE - 4, embedded + schema_at - fields_at,
                               _VECTORS_AT - (fields_at + 4),
                               _VECTORS_AT + 8 - (fields_at + 8), version)
    out += struct.pack("<I4xI", 0, len(blocks))
    for block in blocks:
        out += BLOCK.pack(*block)
    out += meta
    return bytes(out)
