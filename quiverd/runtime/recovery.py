"""Recovering one shard before its actors start (blocking: runs in a worker thread).

    1. segments/   check every segment's metadata (version 2: trailer, footer,
                   directory and manifest under their own CRC, not the stream bytes);
                   a bad one or a leftover temp file moves to quarantine/
                   (``segments.files.scan_segments``)
    2. wal/        replay from the sidecar: torn tail cut into quarantine/, a bad
                   interior entry skipped when its successor validates; then the
                   segments whose bundles the WAL still holds get their whole-file
                   CRC, so that a bad one comes back from the WAL (``_verify_held``)
    3. open segment = exactly the WAL entries no durable segment (nor the
                   DELETED marker) holds, so nothing is lost or duplicated across
                   a crash at any finalize step
    4. loss        sequences no segment, WAL entry or DELETED marker holds, and the
                   gone segments (quarantined, or in ack.log but absent) they were in
    5. ack.log     reconciled with the segment files found (``acks.recovery``):
                   gone segments forgotten, orphans it already deleted unlinked
    6. FLOOR       raised to the highest segment number any of these has seen, so
                   a number is never handed out twice (``_next_segment_seq``)

Startup reads O(number of segments) bytes of segments: the stream bytes of the
others are checked before their first delivery and by the scrubber
(``Recovered.unverified``, actors/quiverd_actors/scrubber.py); the WAL no longer
holds their bundles, so a bad one found then is reported lost, as it would be here.

Bundles of a quarantined segment come back from the WAL while it still holds
them; otherwise they are lost, and so are WAL entries skipped as damage. Every loss
is reported (``runtime.loss.find_loss``): the lost WAL sequence ranges and, for each
segment that is gone, its segment_seq and ack.log's bundle count (bundle ids
``(shard, segment_seq, 0..count-1)``), as ``bundles_lost`` events and in the shard's
``lost_sequences`` / ``lost_bundles``, before ack.log forgets the segment
(SEGMENT_DELETED) so that no subscriber waits for it.
"""

from __future__ import annotations

import bisect

import msgspec

from quiverd.acks import format as ackformat
from quiverd.acks.log import AckLogFile
from quiverd.acks.recovery import gone_segments, replay_acks, settle_acks
from quiverd.acks.state import AckState
from quiverd.kernel import fs
from quiverd.kernel.bundle import (
    META_SLOT,
    PRODUCER_META_FINGERPRINT,
    Bundle,
    MetaCodec,
    split_meta,
)
from quiverd.kernel.config import Config
from quiverd.kernel.durable import fsync_dir, make_dirs
from quiverd.kernel.errors import CorruptRecord
from quiverd.kernel.faults import Hooks
from quiverd.kernel.layout import ShardLayout
from quiverd.kernel.logs import Logger
from quiverd.kernel.producers import ProducerTable, stream_of
from quiverd.kernel.ranges import merge as merge_ranges
from quiverd.runtime.loss import (
    Coverage,
    Loss,
    LostSegment,
    find_loss,
    remembered,
    split_known,
)
from quiverd.segments.files import (
    Deleted,
    Floor,
    NotWritten,
    checked_write,
    delete_segments,
    quarantine_segment,
    read_marker,
    scan_segments,
    verify_file,
)
from quiverd.segments.lost import MAX_SEGMENTS as MAX_LOST_SEGMENTS
from quiverd.segments.lost import LostRecord, read_lost, write_lost
from quiverd.segments.table import SegmentInfo
from quiverd.wal import format as walformat
from quiverd.wal.files import WalFiles
from quiverd.wal.replay import ReplayedEntry, replay_wal

# Loss is logged one event per lost range or segment; past this many, one summary.
MAX_LOSS_EVENTS = 1000


class Recovered(msgspec.Struct, kw_only=True):
    wal: WalFiles
    next_sequence: int
    # WAL entries up to here are held by segments or DELETED (their names fsynced): the
    # shard's WAL writer releases them first thing (0: nothing to release).
    covered_through: int = 0
    next_segment_seq: int
    open_bundles: list[Bundle]
    segments: list[SegmentInfo]
    acks: AckState
    # Segments whose stream bytes no CRC has checked yet (only their metadata's).
    unverified: set[int] = msgspec.field(default_factory=set)
    ack_file: AckLogFile
    # Applied to ``acks`` but not yet in ack.log (startup compaction found no space).
    ack_pending: list[ackformat.Record] = msgspec.field(default_factory=list)
    quarantined_segments: list[str] = msgspec.field(default_factory=list)
    lost_sequences: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # Gone segments whose bundles (shard, segment_seq, 0..bundle_count-1) are lost.
    lost_bundles: list[LostSegment] = msgspec.field(default_factory=list)
    # Losses an earlier start (or the finalizer) already reported (shard-<n>/lost.json):
    # listed, not reported again.
    known_lost_sequences: list[tuple[int, int]] = msgspec.field(default_factory=list)
    known_lost_bundles: list[tuple[int, int | None]] = msgspec.field(default_factory=list)
    replay: dict[str, int] = msgspec.field(default_factory=dict)
    # Named producers' stored bundle numbers: producers.json and the WAL's entries.
    producers: ProducerTable = msgspec.field(default_factory=ProducerTable)


def recover_shard(index: int, shard: ShardLayout, cfg: Config, faults: Hooks,
                  log: Logger) -> Recovered:
    for d in shard.directories():
        make_dirs(d)  # durably: a power cut must not take a new shard's directories
    scan = scan_segments(shard, log)
    segments, quarantined = scan.good, scan.quarantined
    floor = read_marker(shard.floor, Floor)
    deleted = read_marker(shard.deleted, Deleted)
    covered = Coverage(segments, deleted.wal_sequence)
    state = replay_wal(shard.wal_dir, shard.quarantine_dir, cfg_hash=walformat.DEFAULT_CFG_HASH,
                       max_entry_bytes=cfg.wal.max_entry_bytes, log=log, covered=covered)
    bad = _verify_held(shard, segments, scan.unverified, state.entries, log)
    if bad:
        segments = [s for s in segments if s.segment_seq not in bad]
        quarantined = sorted([*quarantined, *bad])
        covered = Coverage(segments, deleted.wal_sequence)
    open_bundles = [_bundle_of(e) for e in state.entries if not covered.holds(e.sequence)]
    by_seq = {s.segment_seq: s for s in segments}
    on_disk = {seq: s.bundle_count for seq, s in by_seq.items()}
    ack_scan = replay_acks(shard, log)
    known = _read_known(shard, log)
    # Torn unsynced entries this start or an earlier one found (lost.json keeps them:
    # once the WAL that showed the damage is released, its gap would read as lost).
    never_acked = [(lo, hi) for lo, hi in merge_ranges([*state.never_acked,
                                                        *known.never_acked])
                   if hi > deleted.wal_sequence]
    loss = find_loss(segments=segments, deleted_sequence=deleted.wal_sequence,
                     wal_sequences=(e.sequence for e in state.entries),
                     gone=gone_segments(ack_scan.state, on_disk, quarantined,
                                          deleted.segment_seqs),
                     never_acked=never_acked)
    # Logged before settle_acks makes ack.log forget the gone segments: a crash in
    # between reports the loss again rather than never. What an earlier start
    # reported (lost.json) is only listed.
    new, old = split_known(loss, known.sequences, (q for q, _ in known.segments))
    _report_loss(index, new, log)
    if old:
        log.info("bundles_lost_known", shard=index, bundles=old.count,
                 ranges=len(old.sequences), path=str(shard.lost_record),
                 hint="reported at an earlier start; listed in status as known")
    known_segments = _remember(shard, loss, known, never_acked, log)
    wal = WalFiles.open(shard.wal_dir, state, cfg_hash=walformat.DEFAULT_CFG_HASH,
                        max_size_bytes=cfg.wal.max_size_bytes,
                        max_chunks=cfg.wal.max_chunks, log=log)
    wal.fault_hook = faults.get("wal")
    acks = None
    # Never reuse a sequence the lost bundles had: producers hold acks naming them.
    next_sequence = max(state.next_sequence, loss.highest_sequence + 1,
                        known.highest_sequence + 1)
    try:
        acks = settle_acks(shard, ack_scan, on_disk, cfg.subscribers, log)
        next_segment_seq = _next_segment_seq(shard, floor, segments, quarantined,
                                             acks.state.segment_floor, log)
        orphans = [by_seq.pop(seq) for seq in acks.orphans]
        delete_segments(shard, orphans, mark=False)  # ack.log recorded them deleted
        # What replay kept is synced now; this life's commit records say so, except for
        # what it found torn and never acknowledged.
        wal.begin(next_sequence - 1,
                  vouch_above=max((hi for _, hi in state.never_acked), default=0))
        covered_through = _covered_through(shard, open_bundles, next_sequence)
    except BaseException:
        wal.close()  # a failed start leaves no file open (a test's daemon, a retry)
        if acks is not None:
            acks.file.close()
        raise
    segments = sorted(by_seq.values(), key=lambda s: s.segment_seq)
    producers = load_producers(shard, state.entries, cfg.ingest.producer_retain_s, log)
    log.info("shard_recovered", segments=len(segments), open_bundles=len(open_bundles),
             wal_entries=len(state.entries), corrupt_entries=state.corrupt_entries,
             torn_tail_bytes=state.torn_tail_bytes, lost_bundles=loss.count)
    return Recovered(
        wal=wal, next_sequence=next_sequence, covered_through=covered_through,
        next_segment_seq=next_segment_seq, open_bundles=open_bundles, segments=segments,
        acks=acks.state, ack_file=acks.file, ack_pending=acks.pending,
        unverified={s.segment_seq for s in segments} & scan.unverified,
        quarantined_segments=[str(q) for q in quarantined], lost_sequences=new.sequences,
        lost_bundles=new.segments, known_lost_sequences=old.sequences,
        known_lost_bundles=known_segments, producers=producers,
        replay={"entries": len(state.entries), "corrupt_entries": state.corrupt_entries,
                "torn_tail_bytes": state.torn_tail_bytes,
                "resynced_bytes": state.resynced_bytes, "bundles_lost": new.count,
                "torn_unsynced_entries": sum(hi - lo + 1 for lo, hi in state.never_acked),
                **{f"ack_log_{k}": v for k, v in acks.counters.items()}})


def _verify_held(shard: ShardLayout, segments: list[SegmentInfo], unverified: set[int],
                  entries: list[ReplayedEntry], log: Logger) -> list[int]:
    """Whole-file CRC of the unverified segments whose bundles the WAL still holds.

    Only a crash between a segment's write and the WAL's release leaves such
    segments (a WAL's worth at most), and only for them can a bad file still be
    recovered from the WAL, so they are checked now rather than at first read.
    Bad ones are quarantined; returns their numbers. Verified ones leave ``unverified``.
    """
    held = sorted(e.sequence for e in entries)
    bad: list[int] = []
    for seg in segments:
        if seg.segment_seq not in unverified:
            continue
        i = bisect.bisect_left(held, seg.first_sequence)
        if i == len(held) or held[i] > seg.last_sequence:
            continue  # released: the WAL cannot give these bundles back
        try:
            verify_file(seg.path)
        except CorruptRecord as exc:
            quarantine_segment(shard, seg.path, exc, log)
            bad.append(seg.segment_seq)
        unverified.discard(seg.segment_seq)
    return bad


def _next_segment_seq(shard: ShardLayout, floor: Floor, segments: list[SegmentInfo],
                      quarantined: list[int], ack_floor: int, log: Logger) -> int:
    """One past every segment number ever used; FLOOR raised to it if it lags.

    A kill between a segment's rename and its FLOOR write leaves FLOOR one behind
    the file; once the gc deletes that file, FLOOR alone would hand its number out
    again, and ack.log (which recorded it deleted) would take the new segment of
    that number for an orphan. ack.log's floor (one past the highest segment it
    ever recorded) and the files found close that window; FLOOR is rewritten so
    that it never depends on them again.
    """
    highest = max([floor.segment_seq, ack_floor - 1, *(s.segment_seq for s in segments),
                   *quarantined])
    if highest > floor.segment_seq:
        try:
            checked_write(shard.floor, msgspec.json.encode(Floor(segment_seq=highest)),
                          mode=0o644)
        except NotWritten as exc:
            # A full disk must not stop a start: the finalizer writes FLOOR with the next
            # segment, and until then this start computes the same number again.
            log.warning("segment_floor_deferred", path=str(shard.floor), error=str(exc),
                        hint="free disk space; FLOOR is written with the next segment")
            return highest + 1
        log.info("segment_floor_raised", from_segment_seq=floor.segment_seq,
                 to_segment_seq=highest, reason="a crash fell between a segment's rename "
                 "and its FLOOR write")
    return highest + 1


def _covered_through(shard: ShardLayout, open_bundles: list[Bundle], next_sequence: int
                     ) -> int:
    """The WAL prefix the segments (and DELETED) already hold, for the writer to release.

    Normally the finalizer releases after each segment. A crash can fall before such a
    release was durable: then the WAL comes back full of entries every segment covers,
    and with the WAL full no new segment can finalize to release it (ingest would wait
    for room for ever). Their names are fsynced first (after a kill -9 a segment's
    rename or DELETED may still be only in the page cache; its bytes were synced before
    the rename)."""
    upto = min((b.sequence for b in open_bundles), default=next_sequence) - 1
    if upto > 0:
        fsync_dir(shard.segments_dir)
    return max(upto, 0)


def load_producers(shard: ShardLayout, entries: list[ReplayedEntry], retain_s: float,
                   log: Logger) -> ProducerTable:
    """producers.json, then every numbered bundle the WAL still holds. A damaged file is
    moved to quarantine/ and reported: resends of bundles only it remembered are then
    stored again (duplicates, never a loss)."""
    table = ProducerTable(retain_s)
    path = shard.producers
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raw = None
    if raw is not None:
        try:
            table = ProducerTable.decode(raw, retain_s)
        except ValueError as exc:
            dest = shard.quarantine_dir / f"{path.name}.{len(raw)}.bad"
            fs.active().rename(path, dest)
            fsync_dir(shard.quarantine_dir)
            fsync_dir(shard.dir)
            log.error("producers_file_unreadable", path=str(path), error=str(exc),
                      moved_to=str(dest),
                      hint="named producers' resends of bundles acked before the last WAL "
                      "release may be stored twice; nothing acknowledged is lost")
    for e in entries:
        for s in e.slots:
            if s.slot == META_SLOT and s.fingerprint == PRODUCER_META_FINGERPRINT:
                client, _txn, tag = MetaCodec.decode(s.ipc)
                if tag is not None:
                    table.add(stream_of(client, tag), tag.seq, e.sequence, e.ts_ns)
    return table  # changed when the WAL added to it: saved before the first release


def _read_known(shard: ShardLayout, log: Logger) -> LostRecord:
    """lost.json; a damaged one only means known losses are reported once more."""
    try:
        return read_lost(shard.lost_record)
    except CorruptRecord as exc:
        log.warning("lost_record_unreadable", path=str(shard.lost_record), error=str(exc),
                    hint="known losses are reported once more; the record is rewritten")
        return LostRecord()


def _remember(shard: ShardLayout, loss: Loss, known: LostRecord,
              never_acked: list[tuple[int, int]], log: Logger) -> list[tuple[int, int | None]]:
    """Rewrite lost.json with what is still lost (and the torn unsynced ranges past the
    DELETED marker); returns the known gone segments. It is written before the shard
    runs, so before the WAL that showed a torn range can be released.

    A record that cannot be written (a full disk at start) is not fatal: the loss is
    then reported once more at the next start."""
    sequences, segments = remembered(loss, known.segments, MAX_LOST_SEGMENTS)
    highest = max([known.highest_sequence, *(hi for _, hi in loss.sequences)])
    record = LostRecord(sequences=sequences, segments=segments, highest_sequence=highest,
                        never_acked=never_acked)
    if record != known:
        try:
            write_lost(shard.lost_record, record)
        except NotWritten as exc:
            log.warning("lost_record_not_written", path=str(shard.lost_record),
                        error=str(exc), hint="the loss is reported again at the next start")
    return list(known.segments)


def _report_loss(index: int, loss: Loss, log: Logger) -> None:
    """One ``bundles_lost`` event per lost sequence range and per gone segment."""
    events = 0
    for lo, hi in loss.sequences:
        if events < MAX_LOSS_EVENTS:
            log.error("bundles_lost", shard=index, first_sequence=lo, last_sequence=hi,
                      bundles=hi - lo + 1,
                      hint="no segment and no WAL entry holds these acknowledged sequences; "
                      "the damaged bytes are in quarantine/")
        events += 1
    for seg in loss.segments:
        if events < MAX_LOSS_EVENTS:
            n = seg.bundle_count
            log.error("bundles_lost", shard=index, segment_seq=seg.segment_seq,
                      bundle_count=n,
                      bundle_ids=f"({index}, {seg.segment_seq}, 0..{n - 1})" if n else None,
                      hint="its segment was quarantined and the WAL no longer holds them")
        events += 1
    if events > MAX_LOSS_EVENTS:
        log.error("bundles_lost_unlisted", shard=index, events=events - MAX_LOSS_EVENTS,
                  bundles=loss.count)


def _bundle_of(entry: ReplayedEntry) -> Bundle:
    client, txn, producer, slots = split_meta(entry.slots)
    return Bundle(client=client, slots=slots, txn=txn, ingestion_ts_ns=entry.ts_ns,
                  sequence=entry.sequence, producer=producer)
