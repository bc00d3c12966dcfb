"""Recovering one shard before its actors start (blocking: runs in a worker thread).

    1. segments/   verify every segment; a bad one or a leftover temp file moves to
                   quarantine/ (``segments.files.scan_segments``)
    2. wal/        replay from the sidecar: torn tail cut into quarantine/, a bad
                   interior entry skipped when its successor validates
    3. open segment = exactly the WAL entries no durable segment (nor the
                   DELETED marker) holds, so nothing is lost or duplicated across
                   a crash at any finalize step
    4. ack.log     replayed and reconciled with the segment files found
                   (``acks.recovery``); orphans it already deleted are unlinked

Bundles of a quarantined segment come back from the WAL while it still holds
them; otherwise their WAL sequences are reported lost (``bundles_lost``).
"""

from __future__ import annotations

import msgspec

from quiverd.acks.log import AckLogFile
from quiverd.acks.recovery import recover_acks
from quiverd.acks.state import AckState
from quiverd.kernel.bundle import Bundle, split_meta
from quiverd.kernel.config import Config
from quiverd.kernel.faults import Hooks
from quiverd.kernel.layout import ShardLayout
from quiverd.kernel.logs import Logger
from quiverd.segments.files import Deleted, Floor, delete_segments, read_marker, scan_segments
from quiverd.segments.table import SegmentInfo
from quiverd.wal import format as walformat
from quiverd.wal.files import WalFiles
from quiverd.wal.replay import ReplayedEntry, replay_wal


class Recovered(msgspec.Struct, kw_only=True):
    wal: WalFiles
    next_sequence: int
    next_segment_seq: int
    open_bundles: list[Bundle]
    segments: list[SegmentInfo]
    acks: AckState
    ack_file: AckLogFile
    quarantined_segments: list[str] = msgspec.field(default_factory=list)
    lost_sequences: list[tuple[int, int]] = msgspec.field(default_factory=list)
    replay: dict[str, int] = msgspec.field(default_factory=dict)


def recover_shard(index: int, shard: ShardLayout, cfg: Config, faults: Hooks,
                  log: Logger) -> Recovered:
    for d in shard.directories():
        d.mkdir(parents=True, exist_ok=True)
    segments, quarantined = scan_segments(shard, log)
    floor = read_marker(shard.floor, Floor)
    deleted = read_marker(shard.deleted, Deleted)
    state = replay_wal(shard.wal_dir, shard.quarantine_dir, cfg_hash=walformat.DEFAULT_CFG_HASH,
                       max_entry_bytes=cfg.wal.max_entry_bytes, log=log)
    covered = _Coverage(segments, deleted.wal_sequence)
    open_bundles = [_bundle_of(e) for e in state.entries if not covered.holds(e.sequence)]
    high = max([deleted.wal_sequence, *(s.last_sequence for s in segments)])
    lost = covered.missing({e.sequence for e in state.entries})
    for lo, hi in lost:
        log.error("bundles_lost", shard=index, first_sequence=lo, last_sequence=hi,
                  hint="their segment was quarantined and the WAL no longer holds them")
    wal = WalFiles.open(shard.wal_dir, state, cfg_hash=walformat.DEFAULT_CFG_HASH,
                        max_size_bytes=cfg.wal.max_size_bytes,
                        max_chunks=cfg.wal.max_chunks, log=log)
    wal.fault_hook = faults.get("wal")
    next_segment_seq = max([floor.segment_seq, *(s.segment_seq for s in segments),
                            *quarantined]) + 1
    by_seq = {s.segment_seq: s for s in segments}
    acks = recover_acks(shard, {seq: s.bundle_count for seq, s in by_seq.items()},
                        cfg.subscribers, log)
    orphans = [by_seq.pop(seq) for seq in acks.orphans]
    delete_segments(shard, orphans)
    segments = sorted(by_seq.values(), key=lambda s: s.segment_seq)
    log.info("shard_recovered", segments=len(segments), open_bundles=len(open_bundles),
             wal_entries=len(state.entries), corrupt_entries=state.corrupt_entries,
             torn_tail_bytes=state.torn_tail_bytes)
    return Recovered(
        wal=wal, next_sequence=max(state.next_sequence, high + 1),
        next_segment_seq=next_segment_seq, open_bundles=open_bundles, segments=segments,
        acks=acks.state, ack_file=acks.file,
        quarantined_segments=[str(q) for q in quarantined], lost_sequences=lost,
        replay={"entries": len(state.entries), "corrupt_entries": state.corrupt_entries,
                "torn_tail_bytes": state.torn_tail_bytes,
                **{f"ack_log_{k}": v for k, v in acks.counters.items()}})


class _Coverage:
    """Which WAL sequences durable segments (or the DELETED marker) already hold."""

    def __init__(self, segments: list[SegmentInfo], deleted_sequence: int) -> None:
        self.ranges = sorted((s.first_sequence, s.last_sequence) for s in segments)
        self.floor = deleted_sequence

    def holds(self, sequence: int) -> bool:
        if sequence <= self.floor:
            return True
        return any(lo <= sequence <= hi for lo, hi in self.ranges)

    def missing(self, in_wal: set[int]) -> list[tuple[int, int]]:
        """Sequence gaps between durable segments that the WAL cannot fill either."""
        lost: list[tuple[int, int]] = []
        prev = self.floor
        for lo, hi in self.ranges:
            if lo > prev + 1:
                gap = [s for s in range(prev + 1, lo) if s not in in_wal]
                if gap:
                    lost.append((gap[0], gap[-1]))
            prev = max(prev, hi)
        return lost


def _bundle_of(entry: ReplayedEntry) -> Bundle:
    client, txn, slots = split_meta(entry.slots)
    return Bundle(client=client, slots=slots, txn=txn, ingestion_ts_ns=entry.ts_ns,
                  sequence=entry.sequence)
