"""Recovering a shard's subscriber state: ack.log replay, reconcile, config subscribers.

Blocking; runs in the shard's recovery thread before any actor starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from quiverd.acks import format as fmt
from quiverd.acks.log import AckLogFile, compact, scan_ack_log
from quiverd.acks.state import AckState
from quiverd.kernel.config import SubscriberEntry
from quiverd.kernel.durable import fsync_dir

ACK_LOG = "ack.log"


def recover_acks(shard_dir: Path, quarantine_dir: Path, on_disk: dict[int, Any],
                 subscribers: list[SubscriberEntry], log: Any
                 ) -> tuple[AckState, AckLogFile, dict[str, int]]:
    """Replay ack.log, make it agree with the segment files, register config subscribers.

    ``on_disk`` maps segment_seq -> SegmentInfo of every valid segment; orphans
    (files ack.log already recorded as deleted) are unlinked and removed from it.
    Returns the state, the open appender (after a compaction that bounds the next
    replay) and the replay report's counters.
    """
    path = shard_dir / ACK_LOG
    report = scan_ack_log(path, quarantine_dir, log=log)
    state = report.state
    fix = state.reconcile({seq: info.bundle_count for seq, info in on_disk.items()})
    for seq in fix.orphans:
        log.warning("segment_orphan_removed", segment_seq=seq,
                    reason="ack.log recorded it deleted; the unlink was cut short")
        os.unlink(on_disk.pop(seq).path)
    if fix.orphans:
        fsync_dir(shard_dir / "segments")
    records: list[Any] = list(fix.records)
    for rec in records:
        state.apply(rec)  # made durable by the compaction below, before anything acts on it
    for sub in subscribers:
        if sub.name not in state.registry:
            state.apply(state.add_subscriber(sub.name, sub.start))
            log.info("subscriber_registered", subscriber=sub.name, start=sub.start,
                     source="config")
    compact(path, state)
    file = AckLogFile.open(path)
    counters = {"corrupt_records": report.corrupt_records,
                "truncated_bytes": report.truncated_bytes,
                "records_replayed": report.records_since_checkpoint}
    return state, file, counters


__all__ = ["recover_acks", "ACK_LOG", "fmt"]
