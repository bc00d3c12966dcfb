"""``spark.readStream.format("quiver")``: a quiverd subscriber as a Structured Streaming source.

    q = (spark.readStream.format("quiver")
         .option("subscriber", "orders-to-parquet")  # required; registered on first use
         .option("client", "web")                    # only this client's bundles (default: all)
         .option("slot", 0)                          # default 0
         .option("maxBundlesPerTrigger", 1000)       # admission control (default: all)
         .option("from", "lake")                     # where a new query starts (below)
         .option("failOnDataLoss", "true")           # default true (see "Loss" below)
         .option("socket", "/run/quiverd/ingest.sock")
         .schema(schema)                             # or the lake's, as for spark.read
         .load())

Where a new query starts (option ``from``; a query restarted from its checkpoint goes
on from there, whatever ``from`` says):

    "lake"      the default: every row of the client already in the lake, then on with
                what the daemon still holds and all that comes later, with no gap and no
                duplicate at the seam (quiverd/spark/stream_history.py): a streaming
                read of a table starts with the table's content, as Delta's and
                Iceberg's do. The daemon's lake off: as "earliest".
    "earliest"  the bundles still in the daemon's segments, then all later ones (Kafka's
                startingOffsets earliest: what the log still retains, not the lake)
    "latest"    only bundles finalized after the query started (Kafka's latest)

The subscriber is registered at "earliest" for "lake" and "earliest". "lake" and a
subscriber that already exists: the segments part starts at its oldest unacked bundle,
and the lake part holds the bundles before it that the lake held when the query started
(a bundle it acked that the uploader had not registered yet is in neither): give a new
query a new subscriber name.

Offsets. One position per shard, ``{"0": [segment_seq, bundle_index], ...}``, each
meaning "after that bundle" (``[s, 4294967295]``: after all of segment s, as the
daemon ends a range that reaches a segment's end; docs/protocol.md "Ranged reads"): a
micro-batch is the range ``(start, end]`` of every shard. Positions are exact (bundle
ids never repeat, segments are finalized read-only files), so a batch Spark re-runs
after a crash reads the same bundles. The daemon computes every offset; the driver never scans data.
While the lake part lasts, an offset also holds the seam (``"lake_through"``), and the
positions before it name bundles read from lake files (stream_history.py).

    driver   initialOffset()   STREAM open (registers the subscriber on first use):
                               just before its oldest unacked bundle, per shard; with
                               from = "lake" that is the seam, and the catalog says
                               whether the lake holds bundles before it
    driver   latestOffset()    in the lake part: the next lake batch's end (catalog rows);
                               else STREAM latest: the end of what is finalized after start,
                               at most maxBundlesPerTrigger bundles (ReadMaxFiles: one
                               bundle counts as one "file"), never past the target
                               of Trigger.AvailableNow, never over an undecided
                               exactly-once job's bundles
    driver   partitions()      in the lake part one HistoryPartition per lake file (catalog
                               rows); then one StreamPartition per shard and span of at
                               most SEGMENTS_PER_PARTITION segment numbers (no STREAM call)
    executor read(HistoryP.)   the file's rows in the range (OpenDAL + pyarrow, as spark.read)
    executor read(StreamP.)    STREAM fetch over the ingest socket: the daemon reads
                               the segment files (one worker hop per 64 bundles) and
                               sends DELIVERY frames → Arrow → the lake's four
                               _quiver_ columns → Spark's Arrow
    driver   commit(end)       STREAM ack_through: acks every bundle up to end, so
                               retention and the gc can free them

Spark calls ``commit(end)`` only after the batch's sink commit is in its checkpoint:
until then the subscriber's bundles stay unacked and retained, so a query killed at
any point restarts from its checkpoint and reads again every range it had not
committed: no loss, and with an idempotent sink (the file sink, foreachBatch keyed
by batch id) no duplicate. A daemon restart between batches changes nothing: the
subscriber's registration and acks are in ack.log. Spark calls ``commit(end)`` when it
plans the next batch, so the acks trail the checkpoint by one batch: the last batch of
an AvailableNow or stopped query is acked only when the query runs again (from its
checkpoint, which starts after it); a new checkpoint on the same subscriber starts at
the oldest unacked bundle (with ``from = "lake"``: after the lake's rows before it) and
reads that batch again.

Latency: only finalized segments are read; a bundle reaches a micro-batch within
``segment.max_open_duration_ms`` (1 s by default) of its ack, plus the trigger interval.
Each row gets the lake's bundle columns (``_quiver_ingested_at``, ``_quiver_shard``,
``_quiver_segment``, ``_quiver_bundle``) when the schema has them, so the stream and the
lake share one schema and a row's bundle id is its dedup key.

Loss. Retention (``retention.size_cap_policy = "drop_oldest"``, ``retention.max_age_s``)
may delete bundles the subscriber has not acked. The daemon names every part of a
range it can no longer deliver (STREAM ``latest`` and ``fetch`` answer ``lost``: shard,
positions, segment numbers, and the subscriber's dropped count there), and the query
fails with all of it (``StreamDataLoss``), as Spark's Kafka source does; with
``failOnDataLoss`` false it prints the same lines to stderr and goes on past the gap.

One query per subscriber. Two queries on one subscriber each ack what they committed,
so one's acks let retention delete what the other has not read. The driver's reader
therefore holds the subscriber's lease (quiverd/net/stream_leases.py) in every open,
latest and ack: a second live query is refused, naming the first (its pid and host).
The lease ends with ``stop()`` or with the driver's process, so Spark's restart of a
stopped or killed query from its checkpoint is not blocked.

The daemon: option ``socket``, or ``config`` (its ingest socket), else the defaults of
quiverd/spark/locator.py ($QUIVERD_SOCKET, the default socket, the default config).
``load("<client>")`` names the client, as for ``spark.read``.
"""

from __future__ import annotations

import os
import socket as socketlib
import sys
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql import types as st
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxFiles,
    SupportsTriggerAvailableNow,
)

from quiverd.client.consumer import RangedReader
from quiverd.kernel.bundle import read_ipc_stream
from quiverd.kernel.config import load
from quiverd.kernel.errors import DaemonUnreachable, QuiverError
from quiverd.kernel.names import client_name_problem, subscriber_name_problem
from quiverd.lake.bundles import slot_table
from quiverd.spark.locator import Locator, defaults
from quiverd.spark.options import STREAM_READ, lowered, refuse_unknown
from quiverd.spark.stream_history import (
    BEFORE_ALL,
    LAKE_THROUGH,
    HistoryPartition,
    LakeSide,
    StreamOffset,
    buffer_ranges,
    has_history,
    lake_end,
    lake_ranges,
    lost_text,
    read_history,
)
from quiverd.spark.types import to_spark

WHERE = 'spark.readStream.format("quiver")'
SEGMENTS_PER_PARTITION = 8  # segment numbers one Spark task reads, at most
BATCH_ROWS = 64 * 1024  # rows per RecordBatch handed to Spark (bundles are concatenated)
TIMEOUT_S = 300.0  # no byte from the daemon for this long fails the call
END_OF_SEGMENT = 0xFFFF_FFFF  # bundle_index u32: (s, END_OF_SEGMENT) is after all of s

Offset = dict[str, Any]  # shard (as a string) -> [segment_seq, bundle_index]; LAKE_THROUGH
STARTS = ("lake", "earliest", "latest")  # option "from"; the first is the default


@dataclass(frozen=True)
class StreamOptions:
    """The source's options, checked."""

    socket: str
    subscriber: str
    client: str | None = None
    slot: int = 0
    max_bundles: int = 0  # 0: no limit
    start: str = "lake"
    fail_on_data_loss: bool = True
    config: str = ""  # the config file the options name (the lake read from it), if any

    @property
    def register_from(self) -> str:
        """Where the daemon starts a new subscriber: the lake part ends where it starts."""
        return "latest" if self.start == "latest" else "earliest"

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> StreamOptions:
        refuse_unknown(options, STREAM_READ, WHERE)
        opts = lowered(options)
        subscriber = opts.get("subscriber", "")
        if not subscriber:
            raise ValueError(f'option "subscriber" is required: {WHERE}.option("subscriber", '
                             '"<name>"), the durable name whose acks record what this query '
                             "has committed (registered on first use)")
        if (problem := subscriber_name_problem(subscriber)) is not None:
            raise ValueError(f'option "subscriber": {problem}')
        named, path = opts.get("client", ""), opts.get("path", "")
        if named and path and named != path:
            raise ValueError(f'load("{path}") names client {path!r}, option "client" '
                             f"{named!r}: give one of them")
        client = named or path or None
        if client is not None and (problem := client_name_problem(client)) is not None:
            raise ValueError(f'option "client": {problem}')
        slot = _int(opts, "slot", 0, low=0, high=62)
        max_bundles = _int(opts, "maxbundlespertrigger", 0, low=1, high=2**31 - 1)
        start = opts.get("from", STARTS[0]).strip().lower()
        if start not in STARTS:
            raise ValueError(f'option "from" must be lake (the default: the lake\'s rows '
                             f'first), earliest or latest, not {start!r}')
        fail = opts.get("failondataloss", "true").strip().lower()
        if fail not in ("true", "false"):
            raise ValueError(f'option "failOnDataLoss" must be true or false, not {fail!r}')
        socket, config = located(opts)
        return cls(socket=socket, subscriber=subscriber, client=client, slot=slot,
                   max_bundles=max_bundles, start=start, fail_on_data_loss=fail == "true",
                   config=config)


def socket_of(opts: Mapping[str, str]) -> str:
    """The ingest socket the options name, or the locator's defaults name."""
    return located(opts)[0]


def located(opts: Mapping[str, str]) -> tuple[str, str]:
    """(ingest socket, config file or "") the options or the locator's defaults name."""
    socket, config, _ = defaults(Locator.parse(opts))
    return socket or str(load(config).ingest_socket), config


@dataclass(frozen=True)
class StreamPartition(InputPartition):
    """The bundles of ``(after, through]`` on one shard."""

    shard: int
    after: tuple[int, int]
    through: tuple[int, int]


class QuiverStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """See the module doc. Spark pickles this object for each process: only ``opts``,
    ``schema`` and the AvailableNow ``target`` travel."""

    def __init__(self, opts: StreamOptions, schema: st.StructType) -> None:
        self.opts = opts
        self.schema = schema
        self.target: Offset | None = None
        # The subscriber's lease holder: this query's driver (the process Spark keeps
        # for the source's offsets and commits; see the module doc).
        self.holder = (f"query reader {uuid.uuid4().hex[:12]}, pid {os.getpid()} on "
                       f"{socketlib.gethostname()}")

    def initialOffset(self) -> Offset:  # noqa: N802 - Spark's name
        """The subscriber's start (registered now if new); with ``from = "lake"`` and
        lake rows before it, every shard before its first bundle and that start as the
        seam. Spark asks again when it restarts a first batch: the answer is the same
        (nothing is acked before a commit, the lake's rows before the seam are fixed)."""
        with self._connect() as r:
            seam = _canon(r.open(self.opts.subscriber, register=True,
                                 start=self.opts.register_from, holder=self.holder)["start"])
        if self.opts.start != "lake":
            return seam
        lake = self._lake()
        at = StreamOffset.parse(seam).positions
        if lake is None or not has_history(lake.files(self.opts.client, self.opts.slot), at):
            return seam
        return StreamOffset(positions=dict.fromkeys(at, BEFORE_ALL), seam=at).json()

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802 - Spark's name
        if self.opts.max_bundles:
            return ReadMaxFiles(self.opts.max_bundles)
        return ReadAllAvailable()

    def latestOffset(self, start: Offset, limit: ReadLimit) -> Offset:  # noqa: N802
        max_bundles = limit.max_files if isinstance(limit, ReadMaxFiles) else 0
        begin = StreamOffset.parse(start)
        if begin.in_lake():
            return self._lake_latest(begin, max_bundles)
        with self._connect() as r:
            reply = r.latest(self.opts.subscriber, start, cap=self.target,
                             max_bundles=max_bundles, holder=self.holder)
        self._lost(reply.get("lost", []), f"planning the batch after {start}")
        self._waiting(reply.get("waiting") or {})
        self.latest = _canon(reply["end"])
        return self.latest

    def _lake_latest(self, begin: StreamOffset, max_bundles: int) -> Offset:
        """The next batch of the lake part (planned from catalog rows), the lease renewed."""
        with self._connect() as r:
            r.open(self.opts.subscriber, holder=self.holder)
        lake = self._lake()
        rows = [] if lake is None else lake.files(self.opts.client, self.opts.slot)
        self.waiting: dict[str, dict[str, Any]] = {}
        self.latest = lake_end(rows, begin, max_bundles).json()
        return self.latest

    def reportLatestOffset(self) -> dict[str, Any] | None:  # noqa: N802 - Spark's name
        """Shown as the source's ``latestOffset`` in the query's progress: the latest
        offset and the undecided exactly-once jobs its shards wait at, shard -> job id
        (``quiverd jobs list``); {} when none. (Spark keeps the last report it got, so
        one is sent every time, not None once the wait is over.)"""
        latest = getattr(self, "latest", None)
        if latest is None:
            return None
        waiting = getattr(self, "waiting", {})
        return {"offset": latest,
                "waiting_for_jobs": {k: w["job_id"] for k, w in sorted(waiting.items())}}

    def _waiting(self, waiting: dict[str, dict[str, Any]]) -> None:
        """Say once per (shard, job) on the driver's stderr what a shard waits for: an
        undecided job's staged rows, which no range may pass (SPEC §7)."""
        said: set[tuple[str, str]] = getattr(self, "said_waiting", set())
        for shard, w in sorted(waiting.items()):
            if (shard, w["job_id"]) not in said:
                said.add((shard, w["job_id"]))
                print(f"quiver stream source: shard {shard} waits at {w['position']} for "
                      f"exactly-once job {w['job_id']!r}, neither committed nor aborted: "
                      "nothing after it is read until it is decided (its writer's "
                      "commit, `quiverd jobs abort`, or staging.writer_timeout_s after its "
                      "writer is gone); see `quiverd jobs list`", file=sys.stderr)
        self.said_waiting = {(k, w["job_id"]) for k, w in waiting.items()}  # said, still on
        self.waiting = waiting

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802 - Spark's name
        """Trigger.AvailableNow: stop at what is finalized now."""
        with self._connect() as r:
            start = r.open(self.opts.subscriber, register=True,
                           start=self.opts.register_from, holder=self.holder)["start"]
            self.target = _canon(r.latest(self.opts.subscriber, start,
                                          holder=self.holder)["end"])

    def partitions(self, start: Offset, end: Offset) -> list[InputPartition]:
        """The lake part's files (one partition each), then the buffer's spans."""
        first, last = StreamOffset.parse(start), StreamOffset.parse(end)
        parts: list[InputPartition] = []
        if ranges := lake_ranges(first, last):
            lake = self._lake()
            if lake is not None:
                files, lost = lake.partitions(ranges, self.opts.client, self.opts.slot)
                self._lost_files(lost)
                parts.extend(files)
        for shard, (after, through) in sorted(buffer_ranges(first, last).items()):
            while after < through:
                last_seg = after[0] + SEGMENTS_PER_PARTITION - 1
                upto = through if last_seg >= through[0] else (last_seg, END_OF_SEGMENT)
                parts.append(StreamPartition(shard=shard, after=after, through=upto))
                after = upto
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        target = to_arrow_schema(self.schema, timezone="UTC")
        if isinstance(partition, HistoryPartition):
            yield from read_history(partition, target)
            return
        assert isinstance(partition, StreamPartition), partition
        pending: list[pa.Table] = []
        rows = 0
        lost: list[dict[str, Any]] = []
        with self._connect() as r:
            for d in r.fetch(self.opts.subscriber, partition.shard, list(partition.after),
                             list(partition.through), client=self.opts.client, lost=lost):
                slot = next((s for s in d.slots if s.slot == self.opts.slot), None)
                if slot is None:
                    continue
                table = slot_table(read_ipc_stream(slot.ipc), shard=d.shard,
                                   segment_seq=d.segment_seq, bundle_index=d.bundle_index,
                                   ingestion_ts_ns=d.ingestion_ts_ns)
                if pending and table.schema != pending[0].schema:
                    yield from _spark_batches(pending, target)
                    pending, rows = [], 0
                pending.append(table)
                rows += table.num_rows
                if rows >= BATCH_ROWS:
                    yield from _spark_batches(pending, target)
                    pending, rows = [], 0
        if pending:
            yield from _spark_batches(pending, target)
        self._lost(lost, f"reading ({partition.after}, {partition.through}] of shard "
                         f"{partition.shard}")

    def commit(self, end: Offset) -> None:
        """Ack through ``end``. A daemon that cannot be reached now is not an error of
        the query: the bundles stay retained, and the next commit acks them too. An end
        in the lake part acks nothing: the subscriber's bundles all follow the seam."""
        if LAKE_THROUGH in end:
            return
        try:
            with self._connect() as r:
                r.ack_through(self.opts.subscriber, end, holder=self.holder)
        except DaemonUnreachable as exc:
            print(f"quiver stream source: commit of {end} not acked now ({exc}); the next "
                  "commit acks it", file=sys.stderr)

    def stop(self) -> None:
        """Give the subscriber's lease back, so the query can start again at once (a
        daemon not reachable now frees it itself once this process ends)."""
        try:
            with self._connect() as r:
                r.release(self.opts.subscriber, self.holder)
        except (DaemonUnreachable, ConnectionError, QuiverError) as exc:
            print(f"quiver stream source: lease of subscriber {self.opts.subscriber!r} not "
                  f"released now ({exc}); it ends with this process", file=sys.stderr)

    def _lost(self, runs: list[dict[str, Any]], doing: str) -> None:
        """Fail the query naming what retention deleted, or (failOnDataLoss false) say so
        on stderr and go on."""
        if not runs:
            return
        text = loss_text(self.opts.subscriber, runs, doing)
        if self.opts.fail_on_data_loss:
            raise StreamDataLoss(f"{text} ({StreamDataLoss.hint})")
        print(f"quiver stream source: {text}; going on (failOnDataLoss is false)",
              file=sys.stderr)

    def _lost_files(self, rows: list[Any]) -> None:
        """Lost lake files in a batch of the lake part: fail naming them, or
        (failOnDataLoss false) say so on stderr and go on without their rows."""
        if not rows:
            return
        text = lost_text(self.opts.subscriber, rows)
        if self.opts.fail_on_data_loss:
            raise StreamDataLoss(f"{text} (to go on without their rows, restart the query "
                                 'with .option("failOnDataLoss", "false"); `quiverd files '
                                 "restore FILE_ID --from PATH` puts a backup back)")
        print(f"quiver stream source: {text}; going on (failOnDataLoss is false)",
              file=sys.stderr)

    def _connect(self) -> RangedReader:
        return RangedReader.connect(self.opts.socket, timeout=TIMEOUT_S)

    def _lake(self) -> LakeSide | None:
        """The daemon's lake (None: it is off), asked on the driver when planning."""
        return LakeSide.open(self.opts.socket, self.opts.config)


class StreamDataLoss(QuiverError):
    """Bundles of the query's range were deleted before it read them."""

    hint = ('to go on past them (they are gone), restart the query with '
            '.option("failOnDataLoss", "false"); to keep unread bundles, give the daemon '
            'more room (retention.size_cap_bytes, retention.max_age_s) or use '
            'retention.size_cap_policy = "backpressure"')


def loss_text(subscriber: str, runs: list[dict[str, Any]], doing: str) -> str:
    """One sentence naming every lost run: shard, positions, segment numbers."""
    parts = []
    for run in runs[:20]:
        first, last = run["segments"]
        segs = f"segment {first}" if first == last else f"segments {first}..{last}"
        parts.append(f"shard {run['shard']} {segs} ((after {run['after']}, through "
                     f"{run['through']}])")
    more = f" and {len(runs) - 20} more" if len(runs) > 20 else ""
    dropped = {int(r["shard"]): int(r.get("dropped_bundles", 0)) for r in runs}
    counts = ", ".join(f"shard {k}: {v}" for k, v in sorted(dropped.items()))
    return (f"data lost while {doing}: retention deleted bundles subscriber {subscriber!r} "
            f"had not read: {'; '.join(parts)}{more} ({len(runs)} range(s); bundles the "
            f"daemon has dropped for this subscriber since it started: {counts})")


def _spark_batches(tables: list[pa.Table], target: pa.Schema) -> Iterator[pa.RecordBatch]:
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    for batch in table.combine_chunks().to_batches():
        yield from to_spark(batch, target).to_batches()


def _canon(offset: Mapping[str, Any]) -> Offset:
    """Shards in numeric order, positions as [segment_seq, bundle_index]: Spark compares
    offsets as JSON text, so equal offsets must print alike."""
    return {k: [int(offset[k][0]), int(offset[k][1])] for k in sorted(offset, key=int)}


def _int(opts: Mapping[str, str], name: str, default: int, *, low: int, high: int) -> int:
    text = opts.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f'option "{name}" must be an integer, not {text!r}') from None
    if not low <= value <= high:
        raise ValueError(f'option "{name}" must be in {low}..{high}, not {value}')
    return value
