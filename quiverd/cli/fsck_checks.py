"""The read-only checks of ``quiverd fsck``, one per file, and what they learn for the loss report.

Per ``shard-<n>/`` (SPEC §2), in replay order::

    wal/truncate.offset      decodes and points into a WAL file (missing is fine)
    wal/quiver.wal[.<gen>]   header, then every entry from the sidecar's position on, read
                             the way replay reads them (``wal dump`` rows): damage with a
                             sound entry after it is skipped, only damage with none after
                             it in the active file is a torn tail
    segments/*.qseg          verify_segment: trailer, footer bounds, CRC, every chunk
    segments/*.qseg.tmp      a finalize cut short (any other non-segment is stray too)
    segments/FLOOR, DELETED  markers decode
    ack.log                  replayed on a copy: header, record CRCs, torn tail

Besides findings, each check records ``ShardFacts``: the WAL sequences replay would
keep, the valid segments' sequence ranges, the DELETED marker and the segments ack.log
lists. ``ShardFacts.loss`` turns them into the lost sequences and bundles
(``runtime.loss``), exactly as daemon recovery would report them.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa

from quiverd.acks import log as acklog
from quiverd.acks.recovery import gone_segments
from quiverd.acks.state import AckState
from quiverd.kernel import layout
from quiverd.kernel.errors import CorruptRecord, FormatMismatch
from quiverd.kernel.layout import ShardLayout
from quiverd.runtime.loss import Coverage, Loss, LostSegment, find_loss, split_known
from quiverd.segments.files import MARKER_TYPES, Deleted, read_marker, segment_info
from quiverd.segments.lost import LostRecord, read_lost
from quiverd.segments.reader import SegmentReader, verify_segment
from quiverd.segments.table import SegmentInfo
from quiverd.wal import dump as waldump
from quiverd.wal import format as wf
from quiverd.wal.commits import split_unsynced
from quiverd.wal.inventory import WalInventory, wal_inventory

# Findings beyond this are counted, not listed: a shredded disk must not make fsck
# hold one object per damaged byte range.
MAX_LISTED = 1000
_SKIPPED_KINDS = frozenset({"corrupt", "skipped"})  # quarantined WAL bytes replay skips


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    offset: int | None
    kind: str
    message: str


class ShardLoss(msgspec.Struct, frozen=True, kw_only=True):
    """Acknowledged bundles of one shard that no file holds any more."""

    shard: int
    count: int  # lost WAL sequences
    sequences: list[tuple[int, int]]  # inclusive ranges
    bundles: list[LostSegment]  # gone segments: bundle ids (shard, segment_seq, 0..count-1)


class Report(msgspec.Struct, kw_only=True):
    findings: list[Finding] = msgspec.field(default_factory=list)
    notes: list[Finding] = msgspec.field(default_factory=list)  # damage already handled
    unlisted_findings: int = 0
    lost: list[ShardLoss] = msgspec.field(default_factory=list)
    # Losses the daemon already reported (shard-<n>/lost.json): listed, not unhealthy.
    known_lost: list[ShardLoss] = msgspec.field(default_factory=list)
    checked: dict[str, int] = msgspec.field(default_factory=Counter)

    @property
    def healthy(self) -> bool:
        return not self.findings and not self.unlisted_findings and not self.lost

    def add(self, path: Path, offset: int | None, kind: str, message: str, *,
            note: bool = False) -> None:
        listed = self.notes if note else self.findings
        if len(listed) < MAX_LISTED:
            listed.append(Finding(path=str(path), offset=offset, kind=kind, message=message))
        elif not note:
            self.unlisted_findings += 1


class ShardFacts:
    """What the checks of one shard learned about where its sequences are."""

    def __init__(self, shard_dir: Path) -> None:
        self.shard = ShardLayout(shard_dir)
        self.index = layout.shard_index(shard_dir.name) or 0
        self.segments: list[SegmentInfo] = []  # valid files
        self.bad_segments: list[int] = []  # startup (and --repair) quarantines them
        self.wal: list[int] = []  # sequences of the entries replay keeps
        self.wal_damage: list[tuple[int, int]] = []  # sequences damage between entries held
        self.commits: list[tuple[int, int]] = []  # (base, synced_through) of WAL commit records
        self.deleted = 0
        self.deleting: list[int] = []  # the DELETED marker's batch (runtime.recovery)
        self.acks: AckState | None = None
        self.unknowable = ""  # why loss cannot be assessed (a file fsck cannot read)

    def coverage(self) -> Coverage:
        return Coverage(self.segments, self.deleted)

    def loss(self) -> Loss | None:
        if self.unknowable:
            return None
        on_disk = {s.segment_seq: s.bundle_count for s in self.segments}
        gone = gone_segments(self.acks or AckState(), on_disk, self.bad_segments,
                             self.deleting)
        _, never = split_unsynced(self.wal_damage, self.commits)  # as replay splits them
        try:  # and what earlier starts found torn and never acked (lost.json), as it does
            never = [*never, *read_lost(self.shard.lost_record).never_acked]
        except CorruptRecord:
            pass  # new_and_known reports the damaged record
        return find_loss(segments=self.segments, deleted_sequence=self.deleted,
                         wal_sequences=self.wal, gone=gone, never_acked=never)

    def new_and_known(self, loss: Loss, report: Report) -> tuple[ShardLoss, ShardLoss]:
        """``loss`` split as daemon recovery splits it: already reported (lost.json) or new."""
        try:
            known = read_lost(self.shard.lost_record)
        except CorruptRecord as exc:
            report.add(self.shard.lost_record, 0, "lost_record",
                       f"{why(exc)}; startup reports known losses once more", note=True)
            known = LostRecord()
        new, old = split_known(loss, known.sequences, (q for q, _ in known.segments))
        gone = {s.segment_seq for s in old.segments}
        old_segments = [*old.segments, *(LostSegment(segment_seq=q, bundle_count=n)
                                         for q, n in known.segments if q not in gone)]
        return (ShardLoss(shard=self.index, count=new.count, sequences=new.sequences,
                          bundles=new.segments),
                ShardLoss(shard=self.index, count=old.count, sequences=old.sequences,
                          bundles=old_segments))


def plan_shard(facts: ShardFacts, report: Report) -> list[tuple[Path, Callable[[], None]]]:
    """One check per file, in replay order: WAL files share sequence state."""
    shard = facts.shard
    inv = wal_inventory(shard.wal_dir)
    work: list[tuple[Path, Callable[[], None]]] = []
    if inv.sidecar_state != "missing":
        work.append((shard.sidecar, partial(_check_sidecar, shard.sidecar, inv, report)))
    rows = _WalRows(report, facts, _wal_quarantined(shard.quarantine_dir))
    work += [(path, partial(rows.check_file, path, gen, inv.active_generation))
             for gen, path in inv.files.items()]
    if shard.segments_dir.is_dir():
        # A marker's .tmp is an atomic write cut short: the marker itself is intact.
        work += [(path, partial(_check_segment_dir, path, report, facts))
                 for path in sorted(shard.segments_dir.iterdir())
                 if not (layout.is_marker(path.name) and path.name not in MARKER_TYPES)]
    if shard.ack_log.exists():
        work.append((shard.ack_log, partial(_check_ack_log, shard.ack_log, report, facts)))
    return work


def _check_sidecar(sidecar: Path, inv: WalInventory, report: Report) -> None:
    report.checked["sidecars"] += 1
    if inv.sidecar_state != "ok":
        report.add(sidecar, 0, "wal_sidecar", f"{strip(inv.sidecar_problem, sidecar)}; "
                   "replay starts at the oldest WAL file instead")


class _WalRows:
    """Turns ``dump_wal`` rows into findings; sequence checks span a shard's files."""

    def __init__(self, report: Report, facts: ShardFacts,
                 handled: dict[int, list[tuple[int, int]]]) -> None:
        self.report = report
        self.facts = facts
        self.handled = handled
        self.last_seq: int | None = None
        self.skipped = 0  # damaged entries since the last sound one: each used a sequence
        self.previous = ""  # kind of the row before
        self.damaged_after: int | None = None  # last sound sequence before damage

    def check_file(self, path: Path, gen: int, active_generation: int) -> None:
        size = file_size(path)
        self.report.checked["wal_files"] += 1
        self.report.checked["wal_bytes"] += size
        # Replay writes the header of an empty active file: a crash right after creating it.
        if size > 0 or gen != active_generation:
            for row in waldump.dump_wal(path):
                self.check(path, gen, row)

    def check(self, path: Path, gen: int, row: dict[str, Any]) -> None:
        kind, offset, report = row["kind"], row.get("offset"), self.report
        previous, self.previous = self.previous, kind
        if kind == "error":
            report.add(path, offset, "wal_header",
                       f"{strip(row['message'], path)}; replay refuses this shard")
            self.facts.unknowable = "a WAL file replay refuses"
        elif kind == "header" and not row["cfg_hash_is_default"]:
            report.add(path, 14, "wal_header", f"segment cfg hash {row['cfg_hash']} is not "
                       "this build's; replay refuses this shard")
            self.facts.unknowable = "a WAL file replay refuses"
        elif kind == "released":
            report.checked["wal_released_bytes"] += row["bytes"]
        elif kind == "hole":
            # Released entries punched out while the sidecar was lost: sequences jump here.
            report.checked["wal_hole_bytes"] += row["bytes"]
            self.last_seq = self.damaged_after = None
        elif kind == "commit":
            self.facts.commits.append((row["base"], row["synced_through"]))
        elif kind == "skipped" and previous == "hole":
            report.add(path, row["offset"], "wal_hole_edge", "tail of a released entry the "
                       "punched hole cut; replay skips it", note=True)
        elif kind == "skipped":
            self._damage(path, gen, row["offset"], row["bytes"], "wal_damage",
                         strip(row["message"], path))
            self.facts.commits.extend(row.get("commits", []))
            if self.damaged_after is None:
                self.damaged_after = self.last_seq
            self.last_seq = None
        elif kind == "torn_tail":
            self.facts.commits.extend(row.get("commits", []))
            report.add(path, offset, "wal_torn_tail", f"last {row['bytes']} bytes are no "
                       f"complete entry ({strip(row['message'], path)}); replay cuts them")
        elif kind == "entry":
            self._entry(path, gen, row)

    def _entry(self, path: Path, gen: int, row: dict[str, Any]) -> None:
        self.report.checked["wal_entries"] += 1
        if row["crc"] != "ok" or row["problem"]:
            why = row["problem"] or "crc mismatch"
            self._damage(path, gen, row["offset"], row["bytes"], "wal_corrupt_entry",
                         f"entry of {row['bytes']} bytes: {why}")
            if not (row["entry_type"] == wf.ENTRY_COMMIT and row["bytes"] == wf.COMMIT_LEN):
                self.skipped += 1  # a damaged commit record used no sequence
            if self.damaged_after is None:
                self.damaged_after = self.last_seq
            return
        if row["entry_type"] not in wf.KNOWN_ENTRY_TYPES:
            return
        seq = row["sequence"]
        self.facts.wal.append(seq)
        if self.damaged_after is not None and seq > self.damaged_after + 1:
            self.facts.wal_damage.append((self.damaged_after + 1, seq - 1))
        self.damaged_after = None
        if self.last_seq is not None and seq != self.last_seq + 1 + self.skipped:
            expected = self.last_seq + 1 + self.skipped
            self.report.add(path, row["offset"], "wal_sequence_gap",
                            f"sequence {seq} where {expected} was expected: entries are missing")
        self.last_seq, self.skipped = seq, 0

    def _damage(self, path: Path, gen: int, offset: int, nbytes: int, kind: str,
                message: str) -> None:
        copied = any(lo <= offset and offset + nbytes <= hi for lo, hi in self.handled.get(gen, []))
        if copied:
            message += "; already copied to quarantine/, replay skips it"
        self.report.add(path, offset, kind, message, note=copied)


def _wal_quarantined(quarantine_dir: Path) -> dict[int, list[tuple[int, int]]]:
    """Byte ranges, per generation, that WAL replay copied to quarantine and skips."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    if quarantine_dir.is_dir():
        for p in quarantine_dir.iterdir():
            parsed = layout.parse_wal_quarantine_name(p.name)
            if parsed is not None and parsed[2] in _SKIPPED_KINDS:
                gen, start, _ = parsed
                ranges.setdefault(gen, []).append((start, start + file_size(p)))
    return ranges


def _check_segment_dir(path: Path, report: Report, facts: ShardFacts) -> None:
    if path.name in MARKER_TYPES:
        try:
            marker = read_marker(path, MARKER_TYPES[path.name])
        except CorruptRecord as exc:
            report.add(path, 0, "segment_marker", f"{why(exc)}; the shard will not start")
            facts.unknowable = f"{path.name} is unreadable"
            return
        if isinstance(marker, Deleted):
            facts.deleted, facts.deleting = marker.wal_sequence, marker.segment_seqs
        return
    seq = layout.segment_seq_of(path.name)
    if seq is None or not path.is_file():
        temp = layout.is_segment_tmp(path.name)
        report.add(path, None, "segment_temp" if temp else "segment_stray",
                   "temp file of a finalize cut short; its bundles are still in the WAL"
                   if temp else "not a segment; startup would quarantine it")
        return
    report.checked["segments"] += 1
    report.checked["segment_bytes"] += file_size(path)
    try:
        verify_segment(path)
        with SegmentReader.open(path) as reader:
            facts.segments.append(segment_info(path, seq, reader))
    except FormatMismatch as exc:
        report.add(path, exc.offset, "segment_format",
                   f"{why(exc)}; not moved: read it with the build that wrote it")
        facts.unknowable = f"segment {path.name} is not readable by this build"
    except CorruptRecord as exc:
        report.add(path, exc.offset, "segment_corrupt", why(exc))
        facts.bad_segments.append(seq)
    except (pa.ArrowException, ValueError, IndexError, KeyError, OSError) as exc:
        # The checksum held, so these are the bytes a writer meant: a bug, not damage.
        # Moving the file would turn a reader bug into lost bundles, so repair leaves it.
        report.add(path, None, "segment_unreadable",
                   f"checksum ok but reading failed: {exc!r}; not moved by --repair")
        facts.unknowable = f"segment {path.name} is unreadable"


def _check_ack_log(path: Path, report: Report, facts: ShardFacts) -> None:
    """Replay a copy: acklog's replay cuts torn tails, and checking must not write."""
    report.checked["ack_logs"] += 1
    report.checked["ack_log_bytes"] += file_size(path)
    events = EventLog()
    with tempfile.TemporaryDirectory(prefix="quiverd-fsck-") as tmp:
        copy = Path(tmp) / path.name
        shutil.copyfile(path, copy)
        try:
            scan = acklog.scan_ack_log(copy, ShardLayout(Path(tmp)).quarantine_dir, log=events)
        except CorruptRecord as exc:
            report.add(path, exc.offset, "ack_log", f"{why(exc)}; the shard will not start")
            return
    facts.acks = scan.state
    for e in (r for r in events.records if r["event"] == "ack_log_quarantined"):
        torn = e["kind"] == "torn_tail"
        report.add(path, e["offset"], "ack_torn_tail" if torn else "ack_corrupt_record",
                   f"{e['bytes']} bytes: " + ("no complete record; replay cuts them" if torn
                                              else "crc mismatch; replay skips the record"))


class EventLog:
    """Logger for replay and quarantine calls: keeps warnings and errors as records."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def info(self, event: str, **kw: Any) -> None:
        pass

    def warning(self, event: str, **kw: Any) -> None:
        self._keep("warning", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        self._keep("error", event, kw)

    def _keep(self, level: str, event: str, kw: dict[str, Any]) -> None:
        if len(self.records) < MAX_LISTED:
            self.records.append({"event": event, "level": level, **kw})


def why(exc: CorruptRecord) -> str:
    return strip(str(exc), exc.path)


def strip(message: str, path: Path | str) -> str:
    """Drop the ``<path> at offset <n>: `` a CorruptRecord puts first: findings name both."""
    return re.sub(rf"{re.escape(str(path))} at offset \d+: ", "", message)


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
