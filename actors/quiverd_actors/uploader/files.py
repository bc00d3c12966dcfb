"""What the uploader and its publisher share: the lake file being built, the coverage
cache, and ``Steps``, which moves a file through its lifecycle states.

An open file is keyed by ``FileKey`` = (shard, client, slot, partition column, hour):
its rows all fall in one hour of one partition column (``lake.partitions``), so its
object key names that hour. A bundle's slot whose rows span hours is split into one
piece per hour, each in its own file and covering the bundle for its hour only.

A step is one catalog transition (retried until the catalog answers: an outage stalls
the lake, never ingest), one log event ``lake_file_<state>`` with the file's id,
client, slot, shard, URI, rows, bytes and the step's duration, one count in
``quiver_lake_file_transitions_total{state}``, and the ``lake`` fault hook (crash
tests stop the process right after a step).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ParamSpec, TypeVar

import anyio
import pyarrow as pa

from quiverd.kernel.backoff import backoff_s
from quiverd.kernel.errors import CatalogUnavailable
from quiverd.kernel.faults import Hook
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import Metrics
from quiverd.lake.bundles import EXTRA_NAMES, slot_table, with_bundle_columns
from quiverd.lake.drift import conform
from quiverd.lake.model import FileRow, FileState
from quiverd.lake.parquet import ActiveFile, FileFacts
from quiverd.lake.partitions import Hour, hour_dirs
from quiverd.lake.tier import Tier

P = ParamSpec("P")
T = TypeVar("T")

# (shard, client, slot, partition column, hour, isolated): ``isolated`` names the one
# bundle a file of its own holds (one that failed a file before), else "".
FileKey = tuple[int, str, int, str, Hour, str]
SlotPart = tuple[int, str]  # (slot, hour partition: ``key_partition``; "" a whole slot)


@dataclass(frozen=True)
class Part:
    """One slot of one bundle, waiting for its row group (the segment's own table)."""

    table: pa.Table
    segment_seq: int
    bundle_index: int
    ingestion_ts_ns: int


@dataclass(eq=False)
class OpenFile:
    """A lake file being filled: buffered parts, then an Active Parquet file."""

    key: FileKey
    file_id: str
    path: Path
    schema: pa.Schema
    opened_at: float  # monotonic
    created_ns: int
    parts: list[Part] = field(default_factory=list)
    buffered_bytes: int = 0
    bundles: list[tuple[int, int]] = field(default_factory=list)  # (segment_seq, index)
    jobs: set[str] = field(default_factory=set)  # Spark jobs whose rows it holds (SPEC §7)
    inflight_bytes: int = 0  # Arrow bytes of the row group being encoded
    written_bytes: int = 0  # the file's size after its last row group (read under lock)
    encoded_bytes: int = 0  # Arrow bytes in its row groups: with the above, the ratio
    seen: pa.Schema | None = None  # the last slot's schema, known to fit ``schema``
    active: ActiveFile | None = None
    frozen: bool = False  # schema fixed: the first row group is being written
    failed: bool = False  # abandoned: its bundles were nacked
    settled: bool = False  # its bundles were acked or nacked (registered, or abandoned)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    # A staged file (uploader/staged.py): the attempt whose rows it holds, the bundles of
    # it delivered published since (None: an ordinary file), when the last one came, and
    # when its attempt was first seen to win.
    attempt: tuple[str, int, int] | None = None
    matched: set[tuple[int, int]] | None = None
    matched_at: float = 0.0
    decided_at: float = 0.0

    def must_wait(self, nbytes: int, row_group_bytes: int, file_size_bytes: int) -> bool:
        """Must intake wait for the row group in flight (and the size check) before
        adding ``nbytes``? Not while the next one fills: waiting there serialized intake
        and encoding and stalled other files' deliveries. Yes once a full row group
        waits, or when the file may reach ``file_size_bytes`` with what is in flight and
        buffered (at its compression ratio so far, 1 before its first row group): a
        burst (a job's commit) cannot pile row groups past the size."""
        if self.buffered_bytes >= row_group_bytes:
            return True
        if not self.lock.locked():
            return False
        ratio = self.written_bytes / self.encoded_bytes if self.encoded_bytes else 1.0
        ahead = self.inflight_bytes + self.buffered_bytes + nbytes
        return self.written_bytes + ratio * ahead >= file_size_bytes

    @property
    def shard(self) -> int:
        return self.key[0]

    @property
    def client(self) -> str:
        return self.key[1]

    @property
    def slot(self) -> int:
        return self.key[2]

    @property
    def hour(self) -> Hour:
        return self.key[4]

    @property
    def part(self) -> str:
        """Its object key's ``date=../hour=..``: what its coverage holds of each bundle."""
        return hour_dirs(self.hour)


class PartsCache:
    """Which (slot, hour) pieces of a segment's bundles registered files already hold:
    asked of the catalog once per (shard, segment), the ``limit`` most recent kept, and
    kept true after each registration (a crash between registering and acking
    redelivers)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.entries: OrderedDict[tuple[int, int], dict[SlotPart, set[int]]] = OrderedDict()

    def get(self, shard: int, segment_seq: int) -> dict[SlotPart, set[int]] | None:
        found = self.entries.get((shard, segment_seq))
        if found is not None:
            self.entries.move_to_end((shard, segment_seq))
        return found

    def put(self, shard: int, segment_seq: int, covered: dict[SlotPart, set[int]]) -> None:
        self.entries[(shard, segment_seq)] = covered
        while len(self.entries) > self.limit:
            self.entries.popitem(last=False)

    def remember(self, f: OpenFile) -> None:
        """File ``f`` was registered: its pieces of its bundles are held."""
        for seg, idx in f.bundles:
            cached = self.entries.get((f.shard, seg))
            if cached is not None:
                cached.setdefault((f.slot, f.part), set()).add(idx)


@dataclass(frozen=True)
class Sealed:
    """A rotated file, on its way to the store and the catalog."""

    file: OpenFile
    facts: FileFacts
    path: Path  # the Stable file


def row_group(parts: list[Part], schema: pa.Schema, shard: int) -> pa.Table:
    """The parts as one table of the file's ``schema``, bundle columns added (worker
    thread): the chunks of the segment's tables, not a copy of them. Parts of one
    schema (the usual case) are joined first, then given their bundle columns and
    conformed once; per part that cost ~3 % of the uploader's CPU."""
    first = parts[0].table.schema
    if not EXTRA_NAMES & set(first.names) and all(p.table.schema.equals(first)
                                                   for p in parts):
        table = parts[0].table if len(parts) == 1 else pa.concat_tables(p.table for p in parts)
        return conform(with_bundle_columns(
            table, [p.table.num_rows for p in parts], shard=shard,
            segment_seqs=[p.segment_seq for p in parts],
            bundle_indexes=[p.bundle_index for p in parts],
            ingestion_ts_ns=[p.ingestion_ts_ns for p in parts]), schema)
    tables = [conform(slot_table(p.table, shard=shard, segment_seq=p.segment_seq,
                                 bundle_index=p.bundle_index,
                                 ingestion_ts_ns=p.ingestion_ts_ns), schema)
              for p in parts]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


class Steps:
    def __init__(self, tier: Tier, *, log: Logger, metrics: Metrics, hook: Hook | None
                 ) -> None:
        self.tier, self.log, self.m, self.hook = tier, log, metrics, hook

    async def catalog(self, fn: Callable[P, Awaitable[T]], *args: P.args,
                      **kwargs: P.kwargs) -> T:
        """Call the catalog until it answers."""
        attempt = 0
        while True:
            try:
                return await fn(*args, **kwargs)
            except CatalogUnavailable as exc:
                attempt += 1
                self.m.lake_errors.labels("catalog").inc()
                delay = backoff_s(attempt)
                self.log.warning("lake_catalog_unavailable", error=str(exc),
                                 retry_in_s=round(delay, 2), hint=exc.hint)
                await anyio.sleep(delay)

    async def transition(self, f: OpenFile, state: FileState, took_s: float,
                         reason: str | None = None, **fields: object) -> None:
        await self.catalog(self._set_state, f.file_id, state, fields)
        self.event(f, state, took_s, reason=reason, uri=fields.get("uri"),
                   rows=fields.get("row_count"), bytes=fields.get("compressed_size"))
        await self.fault(state.value.lower())

    async def _set_state(self, file_id: str, state: FileState, fields: dict[str, object]
                         ) -> None:
        await self.tier.catalog.set_state(file_id, state, **fields)

    def event(self, f: OpenFile, state: FileState, took_s: float, **fields: object) -> None:
        self.m.lake_transitions.labels(state.value).inc()
        self.log.info("lake_file_" + state.value.lower(), file_id=f.file_id, client=f.client,
                      slot=f.slot, shard=f.shard, duration_ms=round(took_s * 1000, 2),
                      **{k: v for k, v in fields.items() if v is not None})

    async def fault(self, step: str) -> None:
        if self.hook is not None:
            await anyio.to_thread.run_sync(self.hook, step)


def file_row(tier: Tier, f: OpenFile, facts: FileFacts, *, uri: str, key: str, local: Path,
             uploaded_at: int) -> FileRow:
    """The complete catalog row of a sealed file (registered as MetaRegistered)."""
    first, last = min(f.bundles), max(f.bundles)
    return FileRow(
        file_id=f.file_id, client_name=f.client, uri=uri, start_ts=facts.start_ts,
        end_ts=facts.end_ts, row_count=facts.rows, uncompressed_size=facts.uncompressed_size,
        compressed_size=facts.compressed_size, schema_hash=facts.schema_hash,
        indexes=list(facts.indexes), uploaded_at=uploaded_at, node_id=tier.node_id,
        source_id=tier.source_id, shard=f.shard, slot=f.slot, object_key=key,
        first_segment=first[0], first_bundle=first[1], last_segment=last[0],
        last_bundle=last[1], bundle_count=len(f.bundles), crc32c=facts.crc32c,
        state=FileState.META_REGISTERED, local_path=str(local), created_at=f.created_ns,
        updated_at=time.time_ns())
