"""Reading Arrow's flatbuffer metadata by hand: just the few fields quiverd needs.

Used by ingest (is a record batch body compressed?) and by delivery (where are the
record batch blocks in a segment stream's IPC file footer?). Every offset is checked
before it is used: out of bounds raises ValueError, never a wrong read.

A flatbuffer table starts with an i32 back to its vtable; the vtable holds u16 sizes,
then one u16 offset per field (0: absent). References to tables and vectors are u32
offsets forward from where they are stored.
"""

from __future__ import annotations

import struct


def field(buf: memoryview, table: int, index: int) -> int | None:
    """Position of a table's field ``index``, or None when absent (flatbuffers vtable)."""
    vtable = table - read(buf, "<i", table)
    vtable_len = read(buf, "<H", vtable)
    slot = 4 + 2 * index
    if slot + 2 > vtable_len:
        return None
    offset = read(buf, "<H", vtable + slot)
    return table + offset if offset else None


def table_field(buf: memoryview, table: int, index: int) -> int | None:
    """The table a field refers to, or None when the field is absent."""
    pos = field(buf, table, index)
    return None if pos is None else table_at(buf, pos)


def table_at(buf: memoryview, pos: int) -> int:
    """The table (or vector) referred to by the u32 offset stored at ``pos``."""
    return pos + read(buf, "<I", pos)


_STRUCTS: dict[str, struct.Struct] = {}


def read(buf: memoryview, fmt: str, pos: int) -> int:
    """One scalar of struct format ``fmt`` at ``pos``, bounds checked.

    Called a dozen times per ingested bundle (the compression check): the compiled
    Struct is kept per format rather than sized and parsed again on every call.
    """
    st = _STRUCTS.get(fmt)
    if st is None:
        st = _STRUCTS[fmt] = struct.Struct(fmt)
    if not 0 <= pos <= len(buf) - st.size:
        raise ValueError("Arrow IPC flatbuffer: offset out of bounds")
    value: int = st.unpack_from(buf, pos)[0]
    return value
