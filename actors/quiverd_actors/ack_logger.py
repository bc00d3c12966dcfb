"""Ack logger: one per shard, the only writer of ack.log, the AckState and the segment table.

    finalizer ──SegmentWritten──────────┐
    dispatcher ─RecordOutcome(s)────────┤
    admin ──────ChangeSubscriber────────┼─▶ ack_logger ──(Changes.notify)──▶ dispatcher, gc_sweeper
    gc_sweeper ─RetireSegments──────────┤         └── Reply given per request
    gc_sweeper ─SegmentsDeleted─────────┘

Each batch of requests becomes ack.log records that are appended and covered by
one fdatasync (group commit); only then are they applied to the AckState and
the segment table, and only then are the requests' replies given, so a
high-water mark is never ahead of the durable acks. A failed fdatasync raises
DurabilityLost (fatal for the shard, never retried); a write that finds no space is
cut back and retried once space returns. The log is compacted into
one checkpoint once ``compact_threshold_bytes`` of records accumulated, which
bounds replay.

The segment table follows ack.log: a segment is listed once its SEGMENT record
is durable, and leaves the table when the gc retires it (after the ``dropped``
outcomes a retention retirement needs are durable), before its file is unlinked.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectReceiveStream

from quiverd.acks import format as fmt
from quiverd.acks.log import AckLogFile
from quiverd.acks.state import AckState
from quiverd.kernel.changes import Changes
from quiverd.kernel.durable import with_path
from quiverd.kernel.errors import DurabilityLost, NoSpace, QuiverError
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import AckLogMetrics
from quiverd.kernel.reply import Reply
from quiverd.segments.table import SegmentTable
from quiverd_actors.messages import (
    AckLogRequest,
    ChangeSubscriber,
    RecordOutcome,
    RecordOutcomes,
    Retired,
    RetireSegments,
    SegmentWritten,
)

MAX_BATCH = 1024
COMPACT_THRESHOLD_BYTES = 4 * 1024 * 1024
NO_SPACE_RETRY_S = 0.05  # doubling to 2 s while ack.log finds no space
NO_SPACE_RETRY_MAX_S = 2.0
COMPACT_RETRY_S = 5.0  # a compaction that found no space is tried again after this


async def run(
    inbox: MemoryObjectReceiveStream[AckLogRequest],
    *,
    state: AckState,
    file: AckLogFile,
    segments: SegmentTable,
    changes: Changes,
    limiter: CapacityLimiter,
    stats: AckLogMetrics,
    log: Logger,
    compact_threshold_bytes: int = COMPACT_THRESHOLD_BYTES,
    pending: list[fmt.Record] | None = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Make requests durable in ack.log, apply them, answer, notify; until ``inbox`` ends.

    ``pending``: records recovery applied to ``state`` but could not write (a start on a
    full disk); they are appended first, so every request waits behind them."""
    stats.log_bytes.set(file.size)
    committer = _Committer(state, file, segments, limiter, stats, log)
    compact_not_before = 0.0
    async with inbox:
        task_status.started()
        try:
            if pending:
                await committer.append(pending)
            async for first in inbox:
                batch = [first]
                while len(batch) < MAX_BATCH:
                    try:
                        batch.append(inbox.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                for chunk in _split_at_subscriber_ops(batch):
                    await committer.commit(chunk)
                changes.notify()
                if (file.should_compact(compact_threshold_bytes)
                        and anyio.current_time() >= compact_not_before):
                    try:
                        size = await anyio.to_thread.run_sync(file.compact, state,
                                                              limiter=limiter)
                    except NoSpace as exc:
                        # The old log is whole and still appended to: compact later.
                        stats.no_space.inc()
                        compact_not_before = anyio.current_time() + COMPACT_RETRY_S
                        log.warning("ack_log_compaction_deferred", error=str(exc),
                                    retry_in_s=COMPACT_RETRY_S, hint=exc.hint)
                        continue
                    stats.log_bytes.set(size)
                    stats.compactions.inc()
                    log.info("ack_log_compacted", bytes=size)
        finally:
            with anyio.CancelScope(shield=True):  # close even when cancelled
                await anyio.to_thread.run_sync(file.close, limiter=limiter)


def _split_at_subscriber_ops(batch: list[AckLogRequest]) -> list[list[AckLogRequest]]:
    """A subscriber add takes its id when applied: at most one per durable batch."""
    chunks: list[list[AckLogRequest]] = [[]]
    for msg in batch:
        if isinstance(msg, ChangeSubscriber) and any(
                isinstance(m, ChangeSubscriber) for m in chunks[-1]):
            chunks.append([])
        chunks[-1].append(msg)
    return chunks


class _Committer:
    """Turns one chunk of requests into records, one fdatasync, state changes and replies."""

    def __init__(self, state: AckState, file: AckLogFile, segments: SegmentTable,
                 limiter: CapacityLimiter, stats: AckLogMetrics, log: Logger) -> None:
        self.state, self.file, self.segments = state, file, segments
        self.limiter, self.stats, self.log = limiter, stats, log

    async def commit(self, chunk: list[AckLogRequest]) -> None:
        records: list[fmt.Record] = []
        answers: list[_Answer] = []
        accepted: list[AckLogRequest] = []
        for msg in chunk:
            try:
                recs, answer = self._propose(msg)
            except (QuiverError, ValueError, KeyError) as exc:
                self._refused(msg, exc, answers)
                continue
            accepted.append(msg)
            records += recs
            if answer is not None:
                answers.append(answer)
        if records:
            await self.append(records)
            for r in records:
                self.state.apply(r)
        for msg in accepted:
            self._update_table(msg)
        for answer in answers:
            answer.give()

    def _refused(self, msg: AckLogRequest, exc: Exception, answers: list[_Answer]) -> None:
        """A request ack.log cannot record: its requester hears why; nothing changes."""
        if (reply := _reply_of(msg)) is not None:
            answers.append(_Answer(reply, error=exc))
        elif isinstance(msg, SegmentWritten):
            # A segment number ack.log has seen before: carrying on would deliver
            # nothing from it and take its file for a deleted segment's orphan.
            raise DurabilityLost(
                f"segment {msg.info.segment_seq} cannot be recorded in ack.log ({exc}); "
                "the shard stops rather than lose its bundles (a bug: segment numbers "
                "must never repeat)") from exc

    def _propose(self, msg: AckLogRequest) -> tuple[list[fmt.Record], _Answer | None]:
        state = self.state
        if isinstance(msg, SegmentWritten):
            if msg.info.segment_seq in state.live_segments():
                return [], None  # announced by recovery already
            return [state.segment_finalized(msg.info.segment_seq, msg.info.bundle_count)], None
        if isinstance(msg, RecordOutcome):
            rec = state.record_outcome(msg.subscriber, msg.segment_seq, msg.bundle_index,
                                       msg.outcome)
            return ([rec] if rec is not None else []), _Answer(msg.reply, value=None)
        if isinstance(msg, RecordOutcomes):
            return self._outcomes(msg)
        if isinstance(msg, ChangeSubscriber):
            change = (state.add_subscriber(msg.name, msg.start) if msg.op == "add"
                      else state.remove_subscriber(msg.name))
            return [change], _Answer(msg.reply, value=None)
        if isinstance(msg, RetireSegments):
            return self._retire(msg)
        return [state.segment_deleted(seq) for seq in msg.segment_seqs], None

    def _outcomes(self, msg: RecordOutcomes) -> tuple[list[fmt.Record], _Answer]:
        """Each outcome as ``RecordOutcome`` would be; one refused changes only itself."""
        records: list[fmt.Record] = []
        errors: list[Exception | None] = []
        for sub, seg, idx, outcome in msg.outcomes:
            try:
                rec = self.state.record_outcome(sub, seg, idx, outcome)
            except (QuiverError, ValueError, KeyError) as exc:
                errors.append(exc)
                continue
            errors.append(None)
            if rec is not None:
                records.append(rec)
        return records, _Answer(msg.reply, value=tuple(errors))

    def _retire(self, msg: RetireSegments) -> tuple[list[fmt.Record], _Answer]:
        """``dropped`` outcomes first for a retention reason; the rows leave the table after."""
        records: list[fmt.Record] = []
        dropped: dict[str, int] = {}
        with_drops = dropped_bytes = 0
        if msg.reason not in ("acked", "corrupt"):  # a quarantined segment: ack.log forgets it
            for seq in msg.segment_seqs:
                plan = self.state.drop_segment(seq)
                records += plan.records
                for sub, n in plan.dropped_by_subscriber.items():
                    dropped[sub] = dropped.get(sub, 0) + n
                if plan.dropped_by_subscriber:
                    with_drops += 1
                    info = self.segments.get(seq)
                    dropped_bytes += info.size_bytes if info is not None else 0
        retiring = tuple(info for seq in msg.segment_seqs
                         if (info := self.segments.get(seq)) is not None)
        return records, _Answer(msg.reply, value=Retired(
            segments=retiring, dropped_by_subscriber=dropped, segments_with_drops=with_drops,
            dropped_bytes=dropped_bytes))

    def _update_table(self, msg: AckLogRequest) -> None:
        """Keep the segment table in step with what ack.log now says."""
        if isinstance(msg, SegmentWritten):
            self.segments.add(msg.info)
        elif isinstance(msg, RetireSegments):
            for seq in msg.segment_seqs:
                self.segments.remove(seq)

    async def append(self, records: list[fmt.Record]) -> None:
        """Append and fdatasync; while no space, cut back and try again with backoff."""
        encoded = [fmt.encode(r) for r in records]
        delay = NO_SPACE_RETRY_S
        waited = False
        while True:
            try:
                await anyio.to_thread.run_sync(_append_sync, self.file, encoded,
                                               limiter=self.limiter)
                break
            except NoSpace as exc:
                # The write was cut back before any fdatasync: retrying it is safe, and
                # the requesters wait meanwhile (a full disk is backpressure).
                self.stats.no_space.inc()
                if not waited:
                    self.log.warning("acklog_disk_full", path=str(self.file.path),
                                     error=str(exc), hint=exc.hint)
                waited = True
                await anyio.sleep(delay)
                delay = min(delay * 2, NO_SPACE_RETRY_MAX_S)
            except OSError as exc:
                raise DurabilityLost(f"ack.log write/fdatasync failed at {self.file.path}: "
                                     f"{exc.strerror or exc}; the shard stops"
                                     ) from with_path(exc, self.file.path)
        if waited:
            self.log.info("acklog_disk_space_back", path=str(self.file.path))
        self.stats.fsyncs.inc()
        self.stats.records.inc(len(records))
        self.stats.log_bytes.set(self.file.size)


@dataclass
class _Answer:
    """A reply to give once the batch is durable and applied."""

    reply: Reply[None] | Reply[Retired] | Reply[tuple[Exception | None, ...]]
    value: None | Retired | tuple[Exception | None, ...] = None
    error: Exception | None = None

    def give(self) -> None:
        if self.error is not None:
            self.reply.fail(self.error)
        else:
            self.reply.set(self.value)  # type: ignore[arg-type]


def _reply_of(msg: AckLogRequest
              ) -> Reply[None] | Reply[Retired] | Reply[tuple[Exception | None, ...]] | None:
    if isinstance(msg, RecordOutcome | RecordOutcomes | ChangeSubscriber | RetireSegments):
        return msg.reply
    return None


def _append_sync(file: AckLogFile, encoded: list[bytes]) -> None:
    file.append(encoded)
    file.sync()


