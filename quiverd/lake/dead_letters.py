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

With the Iceberg projection on (``lake.iceberg.enabled``) each object is also a data file
of the client's dead-letter table, ``quiver_dead_letters.<client>``
(quiverd/lake/iceberg/dead_letters.py). ``SetAside.write`` is the uploader's step, in
this order, and the bundle is rejected only after it returns:

    write the local file ─▶ put the object (its key taken: an earlier write of this
    bundle stands) ─▶ [fault dead_letter_written] ─▶ add it to the table unless the
    table holds it ─▶ [fault dead_letter_committed] ─▶ (the uploader) REJECT

Each step is idempotent per bundle, so a crash anywhere before the REJECT lands in
ack.log delivers the bundle again, it fails again, and the step runs again: the table
gets its file once, never twice and never none. A failure (store, catalog) nacks the
bundle; its next delivery tries the step again.

``reason`` names the failure's class (``reason_of``): the metric
``quiver_lake_dead_letters_total{client,reason}`` and a column of the table.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pyarrow as pa
import pyarrow.parquet as pq

from quiverd.kernel import fs
from quiverd.kernel.bundle import encode_ipc_stream, read_ipc_stream
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import ObjectExists
from quiverd.kernel.logs import Logger

if TYPE_CHECKING:
    from quiverd.lake.iceberg.dead_letters import RemoteDeadLetterTables
    from quiverd.lake.tier import Tier

PREFIX = "dead_letters/"
# The classes of failure (reason_of): a bounded set of metric labels.
SCHEMA_REASON, ENCODE, CAST, OTHER = "schema", "encode", "cast", "other"
SCHEMA = pa.schema([
    pa.field("shard", pa.int32(), nullable=False),
    pa.field("segment_seq", pa.int64(), nullable=False),
    pa.field("bundle_index", pa.int64(), nullable=False),
    pa.field("client", pa.utf8(), nullable=False),
    pa.field("slot", pa.int32(), nullable=False),
    pa.field("ingested_at", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("error", pa.utf8(), nullable=False),
    pa.field("reason", pa.utf8(), nullable=False),  # reason_of(the error): a short class
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
    reason: str
    attempts: int
    rows: int
    payload: bytes

    def table(self) -> pa.Table:
        return read_ipc_stream(self.payload)


def reason_of(exc: BaseException, *, schema: bool = False) -> str:
    """The short class of a bundle's failure: ``schema`` (``schema``: no file here can
    take its schema, refused before a row was written), ``encode`` (a type Parquet has no
    encoding for, e.g. a union), ``cast`` (a value the file's column type cannot hold),
    else ``other``. By the exception's type, never its text."""
    if schema:
        return SCHEMA_REASON
    if isinstance(exc, pa.ArrowNotImplementedError | NotImplementedError):
        return ENCODE
    if isinstance(exc, pa.ArrowInvalid | pa.ArrowTypeError | ValueError | TypeError):
        return CAST
    return OTHER


class SetAside:
    """The uploader's dead-letter step (see the module doc): the object, then the
    Iceberg table's data file; ``write`` returns the object's key."""

    def __init__(self, tier: Tier, *, limiter: anyio.CapacityLimiter,
                 fault: Callable[[str], Awaitable[None]], log: Logger) -> None:
        self.tier, self.limiter, self.fault, self.log = tier, limiter, fault, log
        self._tables: RemoteDeadLetterTables | None = None  # made on the first dead letter

    async def write(self, *, shard: int, segment_seq: int, bundle_index: int, client: str,
                    ingestion_ts_ns: int, tables: dict[int, pa.Table], error: str,
                    reason: str, attempts: int) -> str:
        key = object_key(self.tier.node_id, client, shard, segment_seq, bundle_index,
                         ingestion_ts_ns)
        path = self.tier.data.staging_stable / f"dead-{shard}-{segment_seq}-{bundle_index}.parquet"
        try:
            size, crc = await anyio.to_thread.run_sync(partial(
                write_local, path, shard=shard, segment_seq=segment_seq,
                bundle_index=bundle_index, client=client, ingestion_ts_ns=ingestion_ts_ns,
                tables=tables, error=error, reason=reason, attempts=attempts),
                limiter=self.limiter)
            try:
                await self.tier.store.put_file(key, path, size=size, crc32c=crc)
            except ObjectExists:
                # Written before a crash lost the REJECT, with other bytes (its error
                # read differently this time). That object stands: the table may hold it.
                self.log.info("lake_dead_letter_already_present", key=key)
        finally:
            await anyio.to_thread.run_sync(_unlink_quietly, path)
        await self.fault("dead_letter_written")
        if self.tier.cfg.lake.iceberg.enabled:
            await self._iceberg().add(client, self.tier.store.location(key))
            await self.fault("dead_letter_committed")
        return key

    def _iceberg(self) -> RemoteDeadLetterTables:
        if self._tables is None:
            from quiverd.lake.iceberg.dead_letters import RemoteDeadLetterTables, settings_of

            self._tables = RemoteDeadLetterTables(settings_of(
                self.tier.cfg, self.tier.store.location(""),
                self.tier.store.iceberg_io_properties(), parent_pid=os.getpid()))
        return self._tables


def object_key(node_id: str, client: str, shard: int, segment_seq: int, bundle_index: int,
               ingestion_ts_ns: int) -> str:
    day = time.strftime("%Y-%m-%d", time.gmtime(ingestion_ts_ns / 1e9))
    return (f"{PREFIX}client={client}/date={day}/"
            f"{node_id}_{shard}_{segment_seq}_{bundle_index}.parquet")


def write_local(path: Path, *, shard: int, segment_seq: int, bundle_index: int, client: str,
                ingestion_ts_ns: int, tables: dict[int, pa.Table], error: str,
                reason: str, attempts: int) -> tuple[int, int]:
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
        "reason": pa.array([reason] * len(slots), pa.utf8()),
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


def _unlink_quietly(path: Path) -> None:
    fs.active().unlink(path, missing_ok=True)


def read(key: str, data: bytes) -> list[DeadLetter]:
    t = pq.read_table(pa.BufferReader(data))
    # The integer microseconds as stored (datetime.timestamp() * 1e6 went through a float).
    at_us = t["ingested_at"].cast(pa.int64()).to_pylist()
    return [DeadLetter(key=key, shard=r["shard"], segment_seq=r["segment_seq"],
                       bundle_index=r["bundle_index"], client=r["client"], slot=r["slot"],
                       ingested_at_us=us, error=r["error"], reason=r.get("reason") or "",
                       attempts=r["attempts"], rows=r["rows"], payload=r["payload"])
            for r, us in zip(t.to_pylist(), at_us, strict=True)]
