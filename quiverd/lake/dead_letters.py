"""Dead letters: bundles the lake could not write, set aside instead of looping forever.

A bundle whose slot no Parquet file can take (a value no cast can hold, a schema that
cannot be encoded) fails its file; the uploader then writes it in a file of its own so
the bundles it shared a file with go on, and after ``lake.dead_letter_after`` failures
(3) writes it here and rejects it (ack.log outcome REJECTED: never delivered to the lake
again, its segment may go). One object per bundle, in the store, under a prefix no
client's files use (theirs all start ``client=``):

    dead_letters/client=<client>/<date=YYYY-MM-DD>/<node>_<shard>_<segment>_<bundle>.parquet

one row per slot: the bundle id, client, slot, ingestion time, the error, the attempts,
its row count and its rows as the raw Arrow IPC stream the producer sent. The name is
the bundle's own, so writing it again (a crash between the write and the reject) puts
the same bytes under the same key. ``quiverd dead-letters`` lists them, and
``--replay`` sends their rows again as new bundles (once the cause is fixed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from quiverd.kernel import fs
from quiverd.kernel.bundle import encode_ipc_stream, read_ipc_stream
from quiverd.kernel.crc import crc32c

PREFIX = "dead_letters/"
SCHEMA = pa.schema([
    pa.field("shard", pa.int32(), nullable=False),
    pa.field("segment_seq", pa.int64(), nullable=False),
    pa.field("bundle_index", pa.int64(), nullable=False),
    pa.field("client", pa.utf8(), nullable=False),
    pa.field("slot", pa.int32(), nullable=False),
    pa.field("ingested_at", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("error", pa.utf8(), nullable=False),
    pa.field("attempts", pa.int32(), nullable=False),
    pa.field("rows", pa.int64(), nullable=False),
    pa.field("payload", pa.binary(), nullable=False),  # the slot's Arrow IPC stream
])


@dataclass(frozen=True)
class DeadLetter:
    key: str
    shard: int
    segment_seq: int
    bundle_index: int
    client: str
    slot: int
    ingested_at_us: int
    error: str
    attempts: int
    rows: int
    payload: bytes

    def table(self) -> pa.Table:
        return read_ipc_stream(self.payload)


def object_key(node_id: str, client: str, shard: int, segment_seq: int, bundle_index: int,
               ingestion_ts_ns: int) -> str:
    day = time.strftime("%Y-%m-%d", time.gmtime(ingestion_ts_ns / 1e9))
    return (f"{PREFIX}client={client}/date={day}/"
            f"{node_id}_{shard}_{segment_seq}_{bundle_index}.parquet")


def write_local(path: Path, *, shard: int, segment_seq: int, bundle_index: int, client: str,
                ingestion_ts_ns: int, tables: dict[int, pa.Table], error: str,
                attempts: int) -> tuple[int, int]:
    """The bundle's dead-letter Parquet file at ``path`` (worker thread); (size, crc32c)."""
    slots = sorted(tables)
    table = pa.table({
        "shard": pa.array([shard] * len(slots), pa.int32()),
        "segment_seq": pa.array([segment_seq] * len(slots), pa.int64()),
        "bundle_index": pa.array([bundle_index] * len(slots), pa.int64()),
        "client": pa.array([client] * len(slots), pa.utf8()),
        "slot": pa.array(slots, pa.int32()),
        "ingested_at": pa.array([ingestion_ts_ns // 1000] * len(slots),
                                pa.timestamp("us", tz="UTC")),
        "error": pa.array([error[:4000]] * len(slots), pa.utf8()),
        "attempts": pa.array([attempts] * len(slots), pa.int32()),
        "rows": pa.array([tables[s].num_rows for s in slots], pa.int64()),
        "payload": pa.array([encode_ipc_stream(tables[s]) for s in slots], pa.binary()),
    }, schema=SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    data = sink.getvalue().to_pybytes()
    fs.active().unlink(path, missing_ok=True)  # one a crash left (the same bytes)
    with fs.create_binary(path) as f:  # a staging copy for the upload, deleted after it
        f.write(data)
    return len(data), crc32c(data)


def read(key: str, data: bytes) -> list[DeadLetter]:
    t = pq.read_table(pa.BufferReader(data))
    return [DeadLetter(key=key, shard=r["shard"], segment_seq=r["segment_seq"],
                       bundle_index=r["bundle_index"], client=r["client"], slot=r["slot"],
                       ingested_at_us=int(r["ingested_at"].timestamp() * 1e6),
                       error=r["error"], attempts=r["attempts"], rows=r["rows"],
                       payload=r["payload"])
            for r in t.to_pylist()]
