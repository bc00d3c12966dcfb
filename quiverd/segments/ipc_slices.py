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





