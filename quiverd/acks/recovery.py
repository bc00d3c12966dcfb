"""Recovering a shard's subscriber state: ack.log replay, reconcile, config subscribers.

Blocking; runs in the shard's recovery thread before any actor starts.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from quiverd.acks import format as fmt
from quiverd.acks.log import AckLogFile, compact, scan_ack_log
from quiverd.acks.state import AckState
from quiverd.kernel.config import SubscriberEntry
from quiverd.kernel.layout import ShardLayout
from quiverd.kernel.logs import Logger


class RecoveredAcks(msgspec.Struct, kw_only=True):
    state: AckState
    file: AckLogFile  # the open appender, after a compaction that bounds the next replay
    orphans: list[int]  # segment files ack.log already recorded deleted: unlink them
    counters: dict[str, int]  # the replay report


def recover_acks(shard: ShardLayout, on_disk: Mapping[int, int],
                 subscribers: list[SubscriberEntry], log: Logger) -> RecoveredAcks:
    """Replay ack.log, make it agree with the segment files, register config subscribers.

    ``on_disk`` maps segment_seq -> bundle_count of every valid segment file.
    """
    report = scan_ack_log(shard.ack_log, shard.quarantine_dir, log=log)
    state = report.state
    fix = state.reconcile(on_disk)
    for seq in fix.orphans:
        log.warning("segment_orphan_removed", segment_seq=seq,
                    reason="ack.log recorded it deleted; the unlink was cut short")
    records: list[fmt.Record] = list(fix.records)
    for rec in records:
        state.apply(rec)  # made durable by the compaction below, before anything acts on it
    for sub in subscribers:
        if sub.name not in state.registry:
            state.apply(state.add_subscriber(sub.name, sub.start))
            log.info("subscriber_registered", subscriber=sub.name, start=sub.start,
                     source="config")
    compact(shard.ack_log, state)
    counters = {"corrupt_records": report.corrupt_records,
                "truncated_bytes": report.truncated_bytes,
                "records_replayed": report.records_since_checkpoint}
    return RecoveredAcks(state=state, file=AckLogFile.open(shard.ack_log),
                         orphans=list(fix.orphans), counters=counters)
