"""The established schema of a (client, slot) under ``lake.schema_mode = "strict"``, as
a file: written by the ingest check (``quiverd.net.established``), read back by it after a
restart and by the Spark reader (the schema of a client with no lake file yet).

One file per (client, slot), ``<data_dir>/schemas/<sha256("<client>/<slot>")>.schema``
(client names may be 255 bytes, or "..": they are not file names), written with
``durable.atomic_write`` (tmp, fsync, rename, fsync dir)::

    "QVES"  magic                         4 bytes
    u8      version (1)                   1
    u32     crc32c of everything after    4
    u8      slot                          1
    u8      client length n               1
    n       client (ASCII)
    ...     Arrow IPC schema message (pa.Schema.serialize), to the end

All functions here block: call them from a worker thread on the daemon's loop.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pyarrow as pa

from quiverd.kernel.crc import crc32c
from quiverd.kernel.durable import atomic_write
from quiverd.kernel.errors import CorruptRecord
from quiverd.lake.drift import normalize

SCHEMAS_DIR = "schemas"
MAGIC = b"QVES"
VERSION = 1
HEAD = struct.Struct("<4sBI")  # magic, version, crc32c of the rest
KEY_HEAD = struct.Struct("<BB")  # slot, client length

Key = tuple[str, int]  # (client, slot)


def record_path(data_dir: Path, key: Key) -> Path:
    name = hashlib.sha256(f"{key[0]}/{key[1]}".encode()).hexdigest()
    return Path(data_dir) / SCHEMAS_DIR / f"{name}.schema"


def encode_record(key: Key, schema: pa.Schema) -> bytes:
    client = key[0].encode("ascii")
    rest = KEY_HEAD.pack(key[1], len(client)) + client + schema.serialize().to_pybytes()
    return HEAD.pack(MAGIC, VERSION, crc32c(rest)) + rest


def decode_record(data: bytes, key: Key, path: Path) -> pa.Schema:
    """The schema of a record; CorruptRecord naming the file if it is damaged."""
    def bad(why: str) -> CorruptRecord:
        return CorruptRecord(str(path), 0, f"established schema record of client "
                             f"{key[0]!r} slot {key[1]}: {why}")
    if len(data) < HEAD.size + KEY_HEAD.size:
        raise bad(f"{len(data)} bytes, shorter than its header")
    magic, version, crc = HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise bad(f"magic {magic!r} version {version}, not {MAGIC!r} {VERSION}")
    rest = data[HEAD.size:]
    if crc32c(rest) != crc:
        raise bad("CRC-32C mismatch")
    slot, n = KEY_HEAD.unpack_from(rest)
    client = rest[KEY_HEAD.size:KEY_HEAD.size + n].decode("ascii", "replace")
    if (client, slot) != key:
        raise bad(f"it names client {client!r} slot {slot}")
    try:
        return normalize(pa.ipc.read_schema(pa.py_buffer(rest[KEY_HEAD.size + n:])))
    except (pa.ArrowException, ValueError) as exc:
        raise bad(f"not an Arrow schema ({exc})") from None


def read_record(path: Path, key: Key) -> pa.Schema | None:
    """Blocking (a worker thread): the record's schema, None when there is none."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return decode_record(data, key, path)


def write_record(path: Path, key: Key, schema: pa.Schema) -> None:
    """Blocking (a worker thread): the record, durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, encode_record(key, schema))




def established_record(data_dir: Path, key: Key) -> pa.Schema | None:
    """The record's schema for a reader: None when there is none or it cannot be read
    (a reader falls back to what it has; the daemon reports a damaged record)."""
    try:
        return read_record(record_path(data_dir, key), key)
    except (CorruptRecord, OSError):
        return None
