"""Uploader: the built-in subscriber ``uploader``. Finalized bundles in, Parquet in the lake out.

    dispatcher[n] ──LocalDelivery──▶ uploader ──▶ Active Parquet file per (shard, client,
         ▲                        │               slot, partition column, hour)
         │                        │ rotate on size, time, schema change or window pressure
         │                        ▼
         │                Stable file ──▶ publisher: upload + verify ──▶ register (catalog)
         └──── ack (Feedback, queued) once every piece's file of the bundle is registered

It is a subscriber like any other, so the shared ack.log decides when a segment may
be deleted: a bundle stays on local disk until the files holding it are in the
catalog. Exactly once into the lake (SPEC §6): before a delivered bundle is used, the
catalog is asked which of its slots a registered file already holds (a crash between
registering and acking redelivers it); those slots are skipped, and a bundle with
nothing left is acked at once. The catalog refuses a registration that would cover a
bundle twice (``DuplicateCoverage``); the file is then abandoned and its bundles
nacked, to be redelivered and found covered.

A committed job's rows do not wait for the file timer (read your writes, SPEC §7):
``rush(job_id, bundles)`` names the job's bundles not in the lake yet; once every one
of them has been taken into a file, every open file holding rows of the job is
rotated (reason ``commit``) and published at once. Bundles still on their way are
awaited first, so a job's rows are not cut into a file per delivery batch.

A file never spans two hours (``lake.partitions``): each slot's table is split by hour
of its partition column (``lake.time_column`` when the table has it as a timestamp,
else the bundle's ingestion time, which is one hour), rows whose value is null form a
piece of their own, and each piece goes to the open file of its hour; late rows for an
old hour open a file for that hour (MAX_OPEN_FILES and the window still bound them).
A bundle is acked once every piece's file is registered; each file covers the bundle
for its hour, so a redelivery after a crash writes only the pieces not yet registered.

Every row gets the bundle's ingestion time and id (``lake.bundles``), so the slots of
a bundle rejoin across their files. Parquet encoding runs in worker threads
(``limiter``), one hop per row group, while the file's next row group fills; files of
different clients encode in parallel.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import pyarrow as pa
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from ulid import ULID

from quiverd.acks import format as ackfmt
from quiverd.kernel.errors import LakeError, QuiverError
from quiverd.kernel.faults import Hook
from quiverd.kernel.jobs import END_OFFSET, JobDecision
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import Metrics
from quiverd.lake import dead_letters
from quiverd.lake.bundles import (
    EXTRA_FIELDS,
    close_to_stable,
    time_column_of,
    with_extras,
)
from quiverd.lake.drift import micros_where_lossless, normalize, unify
from quiverd.lake.footers import Footers
from quiverd.lake.health import LakeHealth
from quiverd.lake.model import INGESTED_AT, FileRow, FileState
from quiverd.lake.parquet import ActiveFile, ParquetSettings, file_name
from quiverd.lake.partitions import Hour, hour_dirs, hour_of_ns, partition_column, split_by_hour
from quiverd.lake.tier import Tier
from quiverd_actors.messages import LocalDelivery
from quiverd_actors.sessions import Session
from quiverd_actors.uploader.files import (
    FileKey,
    OpenFile,
    Part,
    PartsCache,
    Sealed,
    SlotPart,
    row_group,
)
from quiverd_actors.uploader.publisher import Publisher, WatchedSteps
from quiverd_actors.uploader.staged import Fate, PieceKey, StagedFiles, complete

SUBSCRIBER = "uploader"
MAX_OPEN_FILES = 128
COVERAGE_CACHE = 1024
PUBLISH_QUEUE = 8

BundleKey = tuple[int, int, int]  # (shard, segment_seq, bundle_index)


class FeedbackSink(Protocol):
    """Where a shard's acks and nacks go: its dispatcher (``Dispatcher.feedback``), known
    by this one method so the uploader does not import another actor."""

    async def feedback(self, session: Session, segment_seq: int, bundle_index: int,
                       outcome: int) -> None: ...


class Uploader:
    def __init__(self, tier: Tier, dispatchers: Sequence[FeedbackSink], session: Session, *,
                 limiter: anyio.CapacityLimiter, log: Logger, metrics: Metrics,
                 health: LakeHealth, hook: Hook | None = None,
                 registered: Callable[[FileRow], None] | None = None,
                 footers: Footers | None = None,
                 decided: Callable[[str], JobDecision | None] | None = None) -> None:
        lake = tier.cfg.lake
        self.decided = decided  # a job's decision, if known here (staged files' fate)
        self.staged = StagedFiles()
        self.registered = registered  # told of every registered file (the projector)
        self.tier, self.lake, self.dispatchers, self.session = tier, lake, dispatchers, session
        self.limiter, self.log, self.m, self.health = limiter, log, metrics, health
        self.steps = WatchedSteps(tier, log=log, metrics=metrics, hook=hook, health=health)
        self.publisher = Publisher(tier, self.steps, log=log, metrics=metrics, health=health,
                                   footers=footers)
        self.set_aside = dead_letters.SetAside(tier, limiter=limiter, fault=self.steps.fault,
                                               log=log)
        self.pending_bytes = 0  # sealed files waiting for upload + registration
        self.settings = ParquetSettings(
            compression_level=lake.compression_level,
            bloom_filter_columns=tuple(lake.index.bloom_filter_columns),
            bloom_filter_fpp=lake.index.bloom_filter_fpp)
        self.files: dict[FileKey, OpenFile] = {}
        self.live: set[OpenFile] = set()  # files with a writer open (aborted at exit)
        self.outstanding: dict[BundleKey, int] = {}  # slot files not yet registered
        # The pieces of each bundle that files not yet settled hold, (slot, hour) -> how
        # many: a bundle nacked through one slot's failed file comes back while another
        # slot's file still holds it, and that piece must not be added again.
        self.held: dict[BundleKey, dict[tuple[int, Hour], int]] = {}
        # Bundles whose file failed on their data (not the disk): how often, the last
        # error and its class (dead_letters.reason_of). Such a bundle is written in a file
        # of its own, and set aside as a dead letter after lake.dead_letter_after failures.
        self.failures: dict[BundleKey, tuple[int, str, str]] = {}
        self.covered = PartsCache(COVERAGE_CACHE)
        self.rushes: dict[str, set[BundleKey]] = {}  # job_id -> its bundles not taken yet
        self.intake: BundleKey | None = None  # the bundle ``_take`` is adding
        self.buffered = 0
        self.buffer_freed = anyio.Event()
        send, recv = anyio.create_memory_object_stream[Sealed](PUBLISH_QUEUE)
        self.publish_tx: MemoryObjectSendStream[Sealed] = send
        self.publish_rx: MemoryObjectReceiveStream[Sealed] = recv

    async def run(self, inbox: MemoryObjectReceiveStream[LocalDelivery], *,
                  task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Consume deliveries until the stream ends or the task is cancelled."""
        try:
            async with inbox, anyio.create_task_group() as tg:
                self.tg = tg
                for _ in range(self.lake.store.max_concurrency):
                    tg.start_soon(self._publisher)
                tg.start_soon(self._timer)
                task_status.started()
                async for delivery in inbox:
                    await self._take(delivery)
                tg.cancel_scope.cancel()
        finally:
            self.publish_tx.close()
            self.publish_rx.close()
            with anyio.CancelScope(shield=True):
                await self._abort_all()

    # ---- committed jobs: publish now -------------------------------------------------
    def rush(self, job_id: str, bundles: set[BundleKey]) -> None:
        """Publish the files holding ``job_id``'s rows as soon as each of ``bundles`` (its
        bundles not yet acked) has been taken; replaces the job's previous request."""
        waiting = {k for k in bundles if k not in self.outstanding or k == self.intake}
        if waiting:
            self.rushes[job_id] = waiting
            return
        self.rushes.pop(job_id, None)
        self._rotate_job(job_id)

    def unrush(self, job_id: str) -> None:
        self.rushes.pop(job_id, None)

    def _rushed(self, key: BundleKey) -> None:
        """Bundle ``key`` was taken: a job waiting for nothing else is published now."""
        for job_id, waiting in list(self.rushes.items()):
            waiting.discard(key)
            if not waiting:
                del self.rushes[job_id]
                self._rotate_job(job_id)

    def _rotate_job(self, job_id: str) -> None:
        for f in list(self.files.values()):
            if job_id in f.jobs:
                self._start_rotation(f, "commit")
        # Every bundle of the job is taken: a staged file of it still waiting for some
        # will not get them (a loser's gets none), so it is given up now.
        for f in self.staged.of_job(job_id):
            if not complete(f):
                self.tg.start_soon(self._give_up, f, "stalled" if f.matched else "lost")

    # ---- staged files: a job's rows converted while it writes (uploader/staged.py) ----
    async def _preview(self, d: LocalDelivery) -> None:
        """A bundle of an undecided job: its pieces go into staged files of its attempt
        now. Nothing is acked; the files wait until the bundle is delivered published.
        Skipped (the usual path takes the bundle then) when staged files would take the
        buffer published rows need, or too many are open."""
        txn = d.txn
        if txn is not None and txn.row_offset == END_OFFSET:
            self._attempt_ended(d.shard, (txn.job_id, txn.partition, txn.attempt))
            return
        if txn is None or not self.staged.room():
            return
        if (d.shard, d.segment_seq, d.bundle_index) in self.failures:
            return  # it fails files: it gets one of its own once published
        try:
            pieces = [(slot, column, hour, table) for slot in sorted(d.tables)
                      for column, hour, table in self._pieces(d, d.tables[slot])]
        except (pa.ArrowException, ValueError):
            return  # its delivery after the commit reports it
        attempt = (txn.job_id, txn.partition, txn.attempt)
        tag = f"{txn.job_id}:{txn.partition}.{txn.attempt}"
        for slot, column, hour, table in pieces:
            piece: PieceKey = (d.shard, d.segment_seq, d.bundle_index, slot, hour)
            if self.staged.holds(piece):
                continue
            nbytes = table.nbytes
            if self.buffered + nbytes > self.lake.max_buffer_bytes // 2:
                return
            try:
                f = await self._staged_file((d.shard, d.client, slot, column, hour, tag),
                                            attempt, table, nbytes)
            except (pa.ArrowException, ValueError):
                return
            if f is None:
                return
            f.parts.append(Part(table=table, segment_seq=d.segment_seq,
                                bundle_index=d.bundle_index, ingestion_ts_ns=d.ingestion_ts_ns))
            f.bundles.append((d.segment_seq, d.bundle_index))
            f.jobs.add(txn.job_id)
            self.staged.add(f, piece)
            f.buffered_bytes += nbytes
            self._buffer(nbytes)
            if f.buffered_bytes >= self.lake.row_group_bytes:
                self.tg.start_soon(self._flush_then_check, f)

    def _attempt_ended(self, shard: int, attempt: tuple[str, int, int]) -> None:
        """The attempt's end marker: no more rows come for its staged files, so their
        last rows are written now, not after the commit (which then only seals them)."""
        for (fkey, a), f in list(self.staged.open.items()):
            if a == attempt and fkey[0] == shard:
                self.staged.full(f)
                if f.parts:
                    self.tg.start_soon(self._flush, f)

    async def _staged_file(self, fkey: FileKey, attempt: tuple[str, int, int],
                           table: pa.Table, nbytes: int) -> OpenFile | None:
        """The staged file of ``attempt`` that takes ``table``; a new one when it cannot
        (the old one still waits for its bundles); None when no more may open."""
        skey = (fkey, attempt)
        f = self.staged.open.get(skey)
        if f is not None and f.must_wait(nbytes, self.lake.row_group_bytes,
                                         self.lake.file_size_bytes):
            await self._flush_then_check(f)
            f = self.staged.open.get(skey)
        if f is not None and f.seen is not None and table.schema.equals(f.seen):
            return f
        incoming = with_extras(table.schema)
        schema = normalize(incoming)
        if f is not None:
            rep = unify(f.schema, incoming)
            if rep is not None and not (f.frozen and rep != f.schema):
                f.schema, f.seen = rep, table.schema
                return f
            self.staged.full(f)
            schema = schema if rep is None else rep
        if not self.staged.room():
            return None
        f = await self._open(fkey, schema, staged=True)
        f.attempt, f.matched, f.seen = attempt, set(), table.schema
        self.staged.open[skey] = f
        self.staged.every.add(f)
        return f

    def _match(self, f: OpenFile, key: BundleKey) -> None:
        """Bundle ``key``, delivered published, has its piece in staged file ``f``: held
        there like a piece added to a file; the file is published once all are."""
        assert f.matched is not None
        f.matched.add((key[1], key[2]))
        f.matched_at = anyio.current_time()
        pieces = self.held.setdefault(key, {})
        pieces[(f.slot, f.hour)] = pieces.get((f.slot, f.hour), 0) + 1
        if complete(f):
            self.staged.forget(f)
            f.frozen = True
            self.m.lake_staged_files.labels("published").inc()
            self.tg.start_soon(self._rotate, f, "staged")

    async def _give_up(self, f: OpenFile, fate: Fate) -> None:
        """A staged file that will not complete: abandoned, and the bundles of it already
        delivered published nacked, to come back and take the usual path."""
        if f.failed or f not in self.staged.every:
            return
        self.staged.forget(f)
        f.failed = True
        async with f.lock:
            if f.active is not None:
                await anyio.to_thread.run_sync(f.active.abort)
            self.live.discard(f)
            self._buffer(-f.buffered_bytes)
            f.parts, f.buffered_bytes = [], 0
        assert f.attempt is not None and f.matched is not None
        self.m.lake_staged_files.labels(fate).inc()
        self.log.info("lake_staged_file_given_up", file_id=f.file_id, client=f.client,
                      slot=f.slot, shard=f.shard, job_id=f.attempt[0],
                      partition=f.attempt[1], attempt=f.attempt[2], reason=fate,
                      bundles=len(f.bundles), matched=len(f.matched))
        row = FileRow(file_id=f.file_id, client_name=f.client, slot=f.slot, shard=f.shard,
                      local_path=str(f.path))
        await self.steps.catalog(self.tier.abandon, row, reason=f"staged file {fate}",
                                 quiet=True)
        await self._settle(f, ackfmt.NACK)

    # ---- intake -------------------------------------------------------------------
    async def _take(self, d: LocalDelivery) -> None:
        if d.staged:
            await self._preview(d)
            return
        key = (d.shard, d.segment_seq, d.bundle_index)
        self.intake = key
        try:
            added = await self._take_slots(d, key)
        finally:
            self.intake = None
        if self.rushes:
            self._rushed(key)
        if added:
            await self._relieve_pressure()

    async def _take_slots(self, d: LocalDelivery, key: BundleKey) -> bool:
        """Put the bundle's slots into their files, one piece per hour of the partition
        column; False when there was nothing to add (every piece already registered)."""
        failed = self.failures.get(key)
        covered = await self._covered(d.shard, d.segment_seq)
        if failed is not None and 0 < self.lake.dead_letter_after <= failed[0]:
            await self._dead_letter(d, key, covered, *failed)
            return False
        isolated = "" if failed is None else f"{d.segment_seq}.{d.bundle_index}"
        try:
            pieces = [(slot, column, hour, table)
                      for slot in sorted(d.tables)
                      if d.bundle_index not in covered.get((slot, ""), ())
                      for column, hour, table in self._pieces(d, d.tables[slot])
                      if not covered  # the usual case: nothing of the segment held yet
                      or d.bundle_index not in covered.get((slot, hour_dirs(hour)), ())]
        except (pa.ArrowException, ValueError) as exc:
            self._refused(d, None, exc)
            await self._feedback(key, ackfmt.NACK)
            return True
        held = self.held.get(key)
        in_flight = 0
        if held:  # redelivered while files in flight hold some of its pieces
            kept = [p for p in pieces if (p[0], p[2]) not in held]
            in_flight = sum(held.values())
            pieces = kept
        if not pieces or len({p[0] for p in pieces}) < len(d.tables):
            self.m.lake_bundles_skipped.labels().inc()
        if not pieces and not in_flight:
            await self._feedback(key, ackfmt.ACK)
            return False
        # Acked once every piece's file is registered, the ones in flight included.
        self.outstanding[key] = len(pieces) + in_flight
        if not pieces:
            self.m.lake_unacked.labels().set(len(self.outstanding))
            return False
        self.m.lake_unacked.labels().set(len(self.outstanding))
        for slot, column, hour, table in pieces:
            if self.staged.pieces and not isolated:
                staged = self.staged.take((d.shard, d.segment_seq, d.bundle_index, slot, hour))
                if staged is not None:  # its rows are in a staged file already
                    self._match(staged, key)
                    continue
            try:
                await self._add(d, (d.shard, d.client, slot, column, hour, isolated), table)
            except (pa.ArrowException, ValueError) as exc:
                # A schema no Parquet file here can take (e.g. a column named twice):
                # nack it; it comes back after a backoff and is reported each time.
                self._refused(d, slot, exc)
                if self.outstanding.pop(key, None) is not None:
                    await self._feedback(key, ackfmt.NACK)
                break
        if isolated:  # its files hold it alone: written now, not after file_duration_ms
            for slot, column, hour, _ in pieces:
                f = self.files.get((d.shard, d.client, slot, column, hour, isolated))
                if f is not None:
                    self._start_rotation(f, "isolated")
        return True

    def _failed_on_data(self, key: BundleKey, exc: BaseException, reason: str) -> None:
        n = self.failures.get(key, (0, "", ""))[0]
        self.failures[key] = (n + 1, f"{type(exc).__name__}: {exc}", reason)

    async def _dead_letter(self, d: LocalDelivery, key: BundleKey,
                           covered: dict[SlotPart, set[int]], attempts: int, error: str,
                           reason: str) -> None:
        """Set the bundle's rows not in the lake aside (its object, then its dead-letter
        table's data file: dead_letters.SetAside) and reject it; on a failure (the store,
        the disk, the Iceberg catalog) nack it: it comes back and is tried again. While a
        file in flight holds a piece of it, nack it too: that piece is in the lake once
        the file registers, or must be in the dead letter if the file fails."""
        if self.held.get(key):
            await self._feedback(key, ackfmt.NACK)
            return
        left = self._not_in_lake(d, covered)
        if not left:  # every piece landed after all
            del self.failures[key]
            await self._feedback(key, ackfmt.ACK)
            return
        shard, seg, idx = key
        try:
            dkey = await self.set_aside.write(
                shard=shard, segment_seq=seg, bundle_index=idx, client=d.client,
                ingestion_ts_ns=d.ingestion_ts_ns, tables=left, error=error, reason=reason,
                attempts=attempts)
        except (OSError, QuiverError, pa.ArrowException) as exc:
            self.log.error("lake_dead_letter_failed", shard=shard, segment_seq=seg,
                           bundle_index=idx, client=d.client,
                           error=f"{type(exc).__name__}: {exc}",
                           hint="the bundle is nacked and tried again")
            await self._feedback(key, ackfmt.NACK)
            return
        self.m.lake_dead_letters.labels(d.client, reason).inc()
        self.log.error("lake_bundle_dead_lettered", shard=shard, segment_seq=seg,
                       bundle_index=idx, client=d.client, attempts=attempts, error=error,
                       reason=reason, key=dkey, hint="the lake could not write it; it is "
                       "set aside and rejected. List with `quiverd dead-letters`, send again with "
                       "--replay once the cause is fixed")
        del self.failures[key]
        await self._feedback(key, ackfmt.REJECTED)

    def _not_in_lake(self, d: LocalDelivery, covered: dict[SlotPart, set[int]]
                     ) -> dict[int, pa.Table]:
        """The bundle's slots without the pieces registered files hold (a replay of the
        dead letter must not send those rows again); a slot with none of them as sent."""
        left: dict[int, pa.Table] = {}
        for slot, table in d.tables.items():
            if d.bundle_index in covered.get((slot, ""), ()):
                continue
            try:
                pieces = self._pieces(d, table)
            except (pa.ArrowException, ValueError):
                left[slot] = table  # not split: no piece of it can be in the lake
                continue
            kept = [t for _, hour, t in pieces
                    if d.bundle_index not in covered.get((slot, hour_dirs(hour)), ())]
            if len(kept) == len(pieces):
                left[slot] = table
            elif kept:
                left[slot] = pa.concat_tables(kept)
        return left

    def _pieces(self, d: LocalDelivery, table: pa.Table) -> list[tuple[str, Hour, pa.Table]]:
        """The slot's rows by hour of its partition column (``lake.partitions``): one
        piece unless they span hours. The ingestion time is the bundle's own, one hour."""
        table = micros_where_lossless(table)  # ns -> us where exact (SPEC §6)
        column = partition_column(table.schema, self.lake.time_column)
        if column == INGESTED_AT or table.num_rows == 0:
            return [(INGESTED_AT, hour_of_ns(d.ingestion_ts_ns), table)]
        return [(column, hour, piece) for hour, piece in split_by_hour(table, column)]

    def _refused(self, d: LocalDelivery, slot: int | None, exc: Exception) -> None:
        self._failed_on_data((d.shard, d.segment_seq, d.bundle_index), exc,
                             dead_letters.reason_of(exc, schema=True))
        self.m.lake_errors.labels("schema").inc()
        self.log.error("lake_bundle_refused", shard=d.shard, segment_seq=d.segment_seq,
                       bundle_index=d.bundle_index, client=d.client, slot=slot,
                       error=f"{type(exc).__name__}: {exc}")

    async def _add(self, d: LocalDelivery, fkey: FileKey, table: pa.Table) -> None:
        nbytes = table.nbytes  # not free (it walks every buffer): once per piece
        f = await self._file_for(fkey, table, nbytes)
        f.parts.append(Part(table=table, segment_seq=d.segment_seq,
                            bundle_index=d.bundle_index, ingestion_ts_ns=d.ingestion_ts_ns))
        f.bundles.append((d.segment_seq, d.bundle_index))
        pieces = self.held.setdefault((d.shard, d.segment_seq, d.bundle_index), {})
        pieces[(f.slot, f.hour)] = pieces.get((f.slot, f.hour), 0) + 1
        if d.txn is not None:
            f.jobs.add(d.txn.job_id)
        f.buffered_bytes += nbytes
        self._buffer(nbytes)
        if f.buffered_bytes >= self.lake.row_group_bytes:
            self.tg.start_soon(self._flush_then_check, f)

    async def _file_for(self, fkey: FileKey, table: pa.Table, nbytes: int) -> OpenFile:
        """The open file that takes ``table``: a new one on a schema it cannot take."""
        f = self.files.get(fkey)
        if f is not None and f.must_wait(nbytes, self.lake.row_group_bytes,
                                         self.lake.file_size_bytes):
            await self._flush_then_check(f)
            f = self.files.get(fkey)
        if f is not None and f.seen is not None and table.schema.equals(f.seen):
            return f  # the schema of the last slot taken: unify would change nothing
        incoming = with_extras(table.schema)
        if f is not None:
            rep = unify(f.schema, incoming)
            if rep is None or (f.frozen and rep != f.schema):
                self._start_rotation(f, "schema")
                f = await self._open(fkey, normalize(incoming) if rep is None else rep)
            else:
                f.schema = rep
        else:
            f = await self._open(fkey, normalize(incoming))
        f.seen = table.schema
        return f

    async def _open(self, fkey: FileKey, schema: pa.Schema, *, staged: bool = False
                    ) -> OpenFile:
        file_id = str(ULID())
        now_ns = time.time_ns()
        name = file_name(self.tier.node_id, now_ns, file_id, "active")
        f = OpenFile(key=fkey, file_id=file_id, path=self.tier.data.staging_active / name,
                     schema=schema, opened_at=anyio.current_time(), created_ns=now_ns)
        if not staged:  # a staged file is the caller's to index
            self.files[fkey] = f
        await self.steps.catalog(self.tier.catalog.insert_file, FileRow(
            file_id=file_id, client_name=fkey[1], node_id=self.tier.node_id,
            source_id=self.tier.source_id, shard=fkey[0], slot=fkey[2],
            state=FileState.RECEIVED, local_path=str(f.path), created_at=now_ns,
            updated_at=now_ns))
        self.steps.event(f, FileState.RECEIVED, 0.0)
        await self.steps.fault("received")
        return f

    async def _relieve_pressure(self) -> None:
        """Bound memory (buffered bytes), open files and bundles held unacked."""
        while self.buffered >= self.lake.max_buffer_bytes:
            biggest = max((f for f in self.files.values() if f.parts),
                          key=lambda f: f.buffered_bytes, default=None)
            if biggest is not None:
                self.tg.start_soon(self._flush_then_check, biggest)
            event = self.buffer_freed
            await event.wait()
        held = sum(len(f.bundles) for f in self.files.values())
        if held >= self.lake.window_bundles // 2 or len(self.files) > MAX_OPEN_FILES:
            oldest = min(self.files.values(), key=lambda f: f.opened_at)
            self._start_rotation(oldest, "window")

    async def _timer(self) -> None:
        tick = min(1.0, self.lake.file_duration_ms / 10_000)  # 100 ms late at most at 1 s
        while True:
            await anyio.sleep(tick)
            now = anyio.current_time()
            for f in list(self.files.values()):
                if (now - f.opened_at) * 1000 >= self.lake.file_duration_ms:
                    self._start_rotation(f, "time")
            if self.staged.every:
                for f, fate in self.staged.fates(now, self.decided):
                    self.tg.start_soon(self._give_up, f, fate)

    # ---- Parquet ------------------------------------------------------------------
    def _pending(self, delta: int) -> None:
        self.pending_bytes += delta
        self.m.lake_pending_bytes.labels().set(self.pending_bytes)

    def _buffer(self, delta: int) -> None:
        self.buffered += delta
        self.m.lake_buffered_bytes.labels().set(self.buffered)
        if delta < 0:
            self.buffer_freed.set()
            self.buffer_freed = anyio.Event()

    async def _flush_then_check(self, f: OpenFile) -> None:
        await self._flush(f)
        if f.attempt is not None:  # staged: full, it waits for its bundles
            if f.active is not None and f.written_bytes >= self.lake.file_size_bytes:
                self.staged.full(f)
            return
        # written_bytes, not active.bytes_written: the next row group may be encoding.
        if (f.active is not None and self.files.get(f.key) is f
                and f.written_bytes >= self.lake.file_size_bytes):
            self._start_rotation(f, "size")

    async def _flush(self, f: OpenFile) -> None:
        async with f.lock:
            parts, f.parts = f.parts, []
            nbytes, f.buffered_bytes = f.buffered_bytes, 0
            if not parts or f.failed:
                self._buffer(-nbytes)
                return
            first = f.active is None
            f.frozen = True
            f.inflight_bytes = nbytes
            started = anyio.current_time()
            try:
                await anyio.to_thread.run_sync(self._encode, f, parts, f.schema,
                                               limiter=self.limiter)
            except (pa.ArrowException, ValueError, TypeError, OSError) as exc:
                await self._fail(f, exc, "append")
                return
            finally:
                f.inflight_bytes = 0
                self._buffer(-nbytes)
            assert f.active is not None
            f.written_bytes, f.encoded_bytes = f.active.bytes_written, f.active.uncompressed_bytes
            took = anyio.current_time() - started
            self.m.lake_append_latency.observe(took)
            if first:
                await self.steps.transition(f, FileState.APPENDED, took)

    def _encode(self, f: OpenFile, parts: list[Part], schema: pa.Schema) -> None:
        """Append the parts as one row group, opening the file first (worker thread)."""
        table = row_group(parts, schema, f.shard)
        if f.active is None:
            f.active = ActiveFile.create(f.path, schema, self.settings, metadata={
                "quiver.file_id": f.file_id, "quiver.client": f.client,
                "quiver.slot": str(f.slot), "quiver.node_id": self.tier.node_id,
                "quiver.source_id": self.tier.source_id, "quiver.shard": str(f.shard)},
                time_column=time_column_of(schema, self.lake.time_column))
            self.live.add(f)
        f.active.append(table)

    def _start_rotation(self, f: OpenFile, reason: str) -> None:
        if f.active is None and not f.parts and not f.frozen:
            # Still being opened (its catalog row is being inserted, perhaps waiting out
            # a catalog outage): nothing to seal yet, and its first part is on the way.
            # (A file whose first row group is being encoded is frozen: it is sealed
            # once that row group is written; a committed job may be waiting for it.)
            return
        if self.files.get(f.key) is f:
            del self.files[f.key]
            f.frozen = True
            self.tg.start_soon(self._rotate, f, reason)

    async def _rotate(self, f: OpenFile, reason: str) -> None:
        await self._flush(f)
        async with f.lock:
            if f.failed:
                return
            if f.active is None:  # no row group was written: nothing to seal
                await self._fail(f, LakeError("rotated before its first row group"), "rotate")
                return
            started = anyio.current_time()
            stable = self.tier.data.staging_stable / file_name(
                self.tier.node_id, f.created_ns, f.file_id, "stable")
            try:
                facts = await anyio.to_thread.run_sync(close_to_stable, f.active, f.path,
                                                       stable, limiter=self.limiter)
            except (pa.ArrowException, ValueError, OSError) as exc:
                await self._fail(f, exc, "rotate")
                return
            self.live.discard(f)
        self.health.ok("staging")
        self.m.lake_rotations.labels(reason).inc()
        self.m.lake_rows.labels().inc(facts.rows)
        await self.steps.transition(f, FileState.ROTATED, anyio.current_time() - started,
                               local_path=str(stable), row_count=facts.rows,
                               uncompressed_size=facts.uncompressed_size,
                               compressed_size=facts.compressed_size, crc32c=facts.crc32c,
                               start_ts=facts.start_ts, end_ts=facts.end_ts,
                               schema_hash=facts.schema_hash, reason=reason)
        self.m.lake_pending_uploads.labels().inc()
        self._pending(facts.compressed_size)
        await self.publish_tx.send(Sealed(file=f, facts=facts, path=stable))

    async def _fail(self, f: OpenFile, exc: BaseException, step: str) -> None:
        """One file's data could not be written (a value no cast can hold, a full or
        failing disk): abandon that file and nack its bundles, which are delivered
        again after a backoff. Other files go on; nothing is acked that is not in the
        lake. A bundle that fails every time shows up here again and again."""
        f.failed = True
        if self.files.get(f.key) is f:
            del self.files[f.key]
        if f.attempt is not None:
            self.staged.forget(f)
            self.m.lake_staged_files.labels("failed").inc()
        self.m.lake_errors.labels("write").inc()
        if f.attempt is None and not isinstance(exc, OSError | LakeError):
            # its data: a bundle of it is the cause (a staged file's bundles get an
            # ordinary file once published, which finds out)
            for seg, idx in f.bundles:
                self._failed_on_data((f.shard, seg, idx), exc, dead_letters.reason_of(exc))
        if isinstance(exc, OSError):  # the staging filesystem (full, read-only, failing)
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            self.health.fail("staging", "no_space" if full else "io", exc,
                             hint="free space on the data directory's filesystem; the "
                             "bundles are nacked and retried")
        self.log.error("lake_file_failed", file_id=f.file_id, client=f.client, slot=f.slot,
                       shard=f.shard, step=step, error=f"{type(exc).__name__}: {exc}",
                       bundles=[list(b) for b in f.bundles[:16]],
                       hint="its bundles are nacked and retried; check free space on the "
                       "data directory, and the log for the same bundles failing again")
        if f.active is not None:
            await anyio.to_thread.run_sync(f.active.abort)
        self.live.discard(f)
        row = FileRow(file_id=f.file_id, client_name=f.client, slot=f.slot, shard=f.shard,
                      local_path=str(f.path))
        await self.steps.catalog(self.tier.abandon, row, reason=f"{step} failed: {exc}")
        await self._settle(f, ackfmt.NACK)

    # ---- upload, register, ack -------------------------------------------------------
    async def _publisher(self) -> None:
        async for sealed in self.publish_rx:
            try:
                row = await self.publisher.publish(sealed)
            finally:
                self.m.lake_pending_uploads.labels().inc(-1)
                self._pending(-sealed.facts.compressed_size)
            if row is not None:
                f = sealed.file
                self.covered.remember(f)  # a redelivery may follow
                await self.steps.fault("registered")
                if self.registered is not None:
                    self.registered(row)
                await self._settle(sealed.file, ackfmt.ACK)
                await self.steps.fault("acked")
            else:
                await self._settle(sealed.file, ackfmt.NACK)

    async def _settle(self, f: OpenFile, outcome: int) -> None:
        """The file's bundles: ack those whose every slot file is registered; nack all
        of them when the file was abandoned (redelivery finds the registered slots)."""
        if f.settled:
            return
        f.settled = True
        piece = (f.slot, f.hour)
        # A staged file settles only the bundles delivered published (matched) since.
        bundles = f.bundles if f.matched is None else [b for b in f.bundles if b in f.matched]
        for seg, idx in bundles:
            key = (f.shard, seg, idx)
            held = self.held.get(key)
            if held is not None and piece in held:
                if held[piece] > 1:
                    held[piece] -= 1
                else:
                    del held[piece]
                    if not held:
                        del self.held[key]
            left = self.outstanding.get(key)
            if left is None:
                continue  # already nacked through another slot's file
            if outcome == ackfmt.NACK:
                del self.outstanding[key]
                await self._feedback(key, ackfmt.NACK)
            elif left <= 1:
                del self.outstanding[key]
                self.failures.pop(key, None)
                await self._feedback(key, ackfmt.ACK)
            else:
                self.outstanding[key] = left - 1
        self.m.lake_unacked.labels().set(len(self.outstanding))

    async def _feedback(self, key: BundleKey, outcome: int) -> None:
        # Only queues a Feedback (no yield while the dispatcher's inbox has room), so
        # a registered file's acks are applied in one dispatcher pass and reach ack.log
        # in one append.
        shard, seg, idx = key
        try:
            await self.dispatchers[shard].feedback(self.session, seg, idx, outcome)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # shutting down: the bundle is delivered again after the restart

    # ---- catalog ------------------------------------------------------------------
    async def _covered(self, shard: int, segment_seq: int) -> dict[SlotPart, set[int]]:
        found = self.covered.get(shard, segment_seq)
        if found is None:
            found = await self.steps.catalog(self.tier.catalog.covered_parts,
                                             self.tier.source_id,
                                             shard, segment_seq)
            self.covered.put(shard, segment_seq, found)
        return found

    async def _abort_all(self) -> None:
        for f in list(self.live):
            if f.active is not None:
                await anyio.to_thread.run_sync(f.active.abort)
        self.live.clear()


__all__ = ["EXTRA_FIELDS", "INGESTED_AT", "MAX_OPEN_FILES", "SUBSCRIBER", "FeedbackSink",
           "Uploader"]
