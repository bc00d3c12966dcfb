"""Recovering a shard's subscriber state: ack.log replay, reconcile, config subscribers.

Two steps, so that the caller can report what ack.log knows about segments that are
gone before reconciling makes ack.log forget them::

    replay_acks()    scan ack.log (torn tail cut into quarantine/) -> ScanReport
    settle_acks()    reconcile with the segment files found (SEGMENT_DELETED for a
                     segment that is gone, so no subscriber waits on it), register
                     config subscribers, compact, open the appender

Blocking; runs in the shard's recovery thread before any actor starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from quiverd.acks import format as fmt
from quiverd.acks.log import AckLogFile, ScanReport, compact, scan_ack_log
from quiverd.acks.state import AckState
from quiverd.kernel.config import SubscriberEntry
from quiverd.kernel.errors import NoSpace
from quiverd.kernel.layout import ShardLayout
from quiverd.kernel.logs import Logger


class RecoveredAcks(msgspec.Struct, kw_only=True):
    state: AckState
    file: AckLogFile  # the open appender, after a compaction that bounds the next replay
    orphans: list[int]  # segment files ack.log already recorded deleted: unlink them
    counters: dict[str, int]  # the replay report
    # Records applied to ``state`` that the startup compaction could not make durable
    # (no space): the ack_logger appends them before any request, retrying like any
    # append that finds no space. Until then a crash recomputes them at the next start.
    pending: list[fmt.Record] = msgspec.field(default_factory=list)


def recover_acks(shard: ShardLayout, on_disk: Mapping[int, int],
                 subscribers: list[SubscriberEntry], log: Logger) -> RecoveredAcks:
    """Replay ack.log, make it agree with the segment files, register config subscribers.

    ``on_disk`` maps segment_seq -> bundle_count of every valid segment file.
    """
    return settle_acks(shard, replay_acks(shard, log), on_disk, subscribers, log)


def replay_acks(shard: ShardLayout, log: Logger) -> ScanReport:
    """ack.log as it is, torn tail cut; ``report.state.live_segments()`` still lists
    every segment it recorded, including those whose file is gone."""
    return scan_ack_log(shard.ack_log, shard.quarantine_dir, log=log)


def gone_segments(state: AckState, on_disk: Mapping[int, int], quarantined: Iterable[int],
                  deleting: Iterable[int] = ()) -> dict[int, int | None]:
    """Segments that should exist but do not, segment_seq -> bundle_count (None: unknown).

    Those ack.log records as live without a valid file, and those quarantined just now
    that ack.log never heard of (a crash before their SEGMENT record); a quarantined
    segment below ack.log's floor was already deleted on purpose. ``deleting`` is the
    DELETED marker's batch: a crash after its unlinks and before its SEGMENT_DELETED
    records leaves those absent yet live in ack.log, and they were deleted on purpose.
    """
    live = state.live_segments()
    quarantined = list(quarantined)
    deleted = set(deleting) - set(quarantined)
    gone: dict[int, int | None] = {seq: n for seq, n in live.items()
                                   if seq not in on_disk and seq not in deleted}
    for seq in quarantined:
        if seq not in live and seq >= state.segment_floor:
            gone[seq] = None
    return dict(sorted(gone.items()))


def settle_acks(shard: ShardLayout, report: ScanReport, on_disk: Mapping[int, int],
                subscribers: list[SubscriberEntry], log: Logger) -> RecoveredAcks:
    """Reconcile a replayed ack.log with the segment files, register config subscribers."""
    state = report.state
    fix = state.reconcile(on_disk)
    for seq in fix.orphans:
        log.warning("segment_orphan_removed", segment_seq=seq,
                    reason="ack.log recorded it deleted; the unlink was cut short")
    for rec in fix.records:
        if isinstance(rec, fmt.SegmentDeleted):
            log.warning("segment_forgotten", segment_seq=rec.segment_seq,
                        reason="its file is gone (quarantined or removed): no subscriber "
                        "waits for its bundles")
    records: list[fmt.Record] = list(fix.records)
    for rec in records:
        state.apply(rec)  # made durable by the compaction below, before anything acts on it
    for sub in subscribers:
        if sub.name not in state.registry:
            records.append(state.add_subscriber(sub.name, sub.start))
            state.apply(records[-1])
            log.info("subscriber_registered", subscriber=sub.name, start=sub.start,
                     source="config")
    pending: list[fmt.Record] = []
    try:
        compact(shard.ack_log, state)
    except NoSpace as exc:
        # A full disk must not stop a start: reads and drains need no new space. The
        # old ack.log is whole; replay stays bounded by its size plus one batch.
        pending = records
        log.warning("ack_log_compaction_deferred", path=str(shard.ack_log), error=str(exc),
                    pending_records=len(pending), hint=exc.hint)
    counters = {"corrupt_records": report.corrupt_records,
                "truncated_bytes": report.truncated_bytes,
                "records_replayed": report.records_since_checkpoint}
    return RecoveredAcks(state=state, file=AckLogFile.open(shard.ack_log),
                         orphans=list(fix.orphans), counters=counters, pending=pending)
