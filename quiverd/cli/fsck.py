"""``quiverd fsck DATA_DIR [--repair] [--json]``: verify a stopped daemon's data directory.

Checked per ``shard-<n>/`` (SPEC §2)::

    wal/truncate.offset      decodes and points into a WAL file (missing is fine)
    wal/quiver.wal[.<gen>]   header (magic, version, cfg hash), then every entry's CRC
                             from the sidecar's position on: bytes before it are
                             released (maybe punched holes), never read as entries
    segments/*.qseg          verify_segment: trailer, footer bounds, CRC, every chunk
    segments/*.qseg.tmp      a finalize cut short (any other non-segment is stray too)
    segments/FLOOR, DELETED  markers decode
    ack.log                  replayed on a copy: header, record CRCs, torn tail

Checking never writes (LOCK is created if absent, to flock it). ``--repair`` does
what daemon startup would do, then checks again: bad segments and temp files move
to ``quarantine/``, WAL replay copies damage there and cuts torn tails, ack.log
replay does the same (plus a compaction that drops records it copied). Nothing is
deleted. Damage replay already copied to quarantine but still skips is a note,
not a finding: it no longer needs a repair.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import msgspec
import pyarrow as pa

from quiverd.acks import log as acklog
from quiverd.kernel import layout
from quiverd.kernel.errors import CorruptRecord, FormatMismatch, QuiverError
from quiverd.kernel.layout import ShardLayout
from quiverd.kernel.quarantine import move_file
from quiverd.runtime.lockfile import lock_data_dir
from quiverd.segments.files import MARKER_TYPES, read_marker
from quiverd.segments.reader import verify_segment
from quiverd.wal import dump as waldump
from quiverd.wal import format as wf
from quiverd.wal import replay as walreplay

# Findings beyond this are counted, not listed: a shredded disk must not make fsck
# hold one object per damaged byte range.
MAX_LISTED = 1000
# fsck has no config: accept any length a u32 allows, so a repair never cuts an
# entry a daemon with a large ``wal.max_entry_bytes`` would keep.
MAX_ENTRY_BYTES = wf.MAX_ENTRY_LEN
_SKIPPED_KINDS = frozenset({"corrupt", "skipped"})  # quarantined WAL bytes replay skips
_MOVED_KINDS = frozenset({"segment_corrupt", "segment_temp", "segment_stray", "wal_sidecar"})
_WAL_REPLAY_KINDS = frozenset({"wal_torn_tail", "wal_corrupt_entry", "wal_damage"})
_ACK_REPLAY_KINDS = frozenset({"ack_torn_tail", "ack_corrupt_record"})


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    offset: int | None
    kind: str
    message: str


class Report(msgspec.Struct, kw_only=True):
    findings: list[Finding] = msgspec.field(default_factory=list)
    notes: list[Finding] = msgspec.field(default_factory=list)  # damage already handled
    unlisted_findings: int = 0
    checked: dict[str, int] = msgspec.field(default_factory=Counter)

    @property
    def healthy(self) -> bool:
        return not self.findings and not self.unlisted_findings

    def add(self, path: Path, offset: int | None, kind: str, message: str, *,
            note: bool = False) -> None:
        listed = self.notes if note else self.findings
        if len(listed) < MAX_LISTED:
            listed.append(Finding(path=str(path), offset=offset, kind=kind, message=message))
        elif not note:
            self.unlisted_findings += 1


def run_fsck(data_dir: Path, *, repair: bool, as_json: bool) -> int:
    """Check ``data_dir`` (and repair it); exit code 0 when healthy, 1 with findings."""
    lock_fd = _lock(data_dir)
    try:
        shards = shard_dirs(data_dir)
        progress = _Progress(sys.stderr if sys.stderr.isatty() else None)
        report = check_data_dir(shards, progress)
        repairs: list[dict[str, Any]] = []
        if repair and not report.healthy:
            repairs = repair_findings(report.findings)
            report = check_data_dir(shards, progress)
        if as_json:
            out = {"healthy": report.healthy, **msgspec.to_builtins(report),
                   **({"repairs": repairs} if repair else {})}
            print(json.dumps(out, default=str))
        else:
            _print_summary(data_dir, report, repairs, repair=repair)
        return 0 if report.healthy else 1
    finally:
        os.close(lock_fd)


def shard_dirs(data_dir: Path) -> list[Path]:
    found = {i: p for p in data_dir.iterdir()
             if p.is_dir() and (i := layout.shard_index(p.name)) is not None}
    return [found[i] for i in sorted(found)]


def check_data_dir(shards: list[Path], progress: _Progress) -> Report:
    """Read-only check of every shard; findings say what replay or startup would hit."""
    report = Report()
    work = [item for shard in shards for item in _plan(shard, report)]
    sizes = [_size(path) for path, _ in work]
    progress.start(len(work), sum(sizes))
    for (_, check), size in zip(work, sizes, strict=True):
        check()
        progress.advance(size)
    progress.finish()
    report.checked["shards"] = len(shards)
    return report


def _plan(shard_dir: Path, report: Report) -> list[tuple[Path, Callable[[], None]]]:
    """One check per file, in replay order: WAL files share sequence state."""
    shard = ShardLayout(shard_dir)
    inv = walreplay.wal_inventory(shard.wal_dir)
    work: list[tuple[Path, Callable[[], None]]] = []
    if inv.sidecar_state != "missing":
        work.append((shard.sidecar, partial(_check_sidecar, shard.sidecar, inv, report)))
    rows = _WalRows(report, _wal_quarantined(shard.quarantine_dir))
    work += [(path, partial(rows.check_file, path, gen, inv.active_generation))
             for gen, path in inv.files.items()]
    if shard.segments_dir.is_dir():
        # A marker's .tmp is an atomic write cut short: the marker itself is intact.
        work += [(path, partial(_check_segment_dir, path, report))
                 for path in sorted(shard.segments_dir.iterdir())
                 if not (layout.is_marker(path.name) and path.name not in MARKER_TYPES)]
    if shard.ack_log.exists():
        work.append((shard.ack_log, partial(_check_ack_log, shard.ack_log, report)))
    return work


def _check_sidecar(sidecar: Path, inv: walreplay.WalInventory, report: Report) -> None:
    report.checked["sidecars"] += 1
    if inv.sidecar_state != "ok":
        report.add(sidecar, 0, "wal_sidecar", f"{_strip(inv.sidecar_problem, sidecar)}; "
                   "replay starts at the oldest WAL file instead")


class _WalRows:
    """Turns ``dump_wal`` rows into findings; sequence checks span a shard's files."""

    def __init__(self, report: Report, handled: dict[int, list[tuple[int, int]]]) -> None:
        self.report = report
        self.handled = handled
        self.last_seq: int | None = None
        self.skipped = 0  # damaged entries since the last sound one: each used a sequence
        self.previous = ""  # kind of the row before

    def check_file(self, path: Path, gen: int, active_generation: int) -> None:
        size = _size(path)
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
                       f"{_strip(row['message'], path)}; replay refuses this shard")
        elif kind == "header" and not row["cfg_hash_is_default"]:
            report.add(path, 14, "wal_header", f"segment cfg hash {row['cfg_hash']} is not "
                       "this build's; replay refuses this shard")
        elif kind == "released":
            report.checked["wal_released_bytes"] += row["bytes"]
        elif kind == "hole":
            # Released entries punched out while the sidecar was lost: sequences jump here.
            report.checked["wal_hole_bytes"] += row["bytes"]
            self.last_seq = None
        elif kind == "skipped" and previous == "hole":
            report.add(path, row["offset"], "wal_hole_edge", "tail of a released entry the "
                       "punched hole cut; replay skips it", note=True)
        elif kind == "skipped":
            self._damage(path, gen, row["offset"], row["bytes"], "wal_damage",
                         _strip(row["message"], path))
            self.last_seq = None
        elif kind == "torn_tail":
            report.add(path, offset, "wal_torn_tail", f"last {row['bytes']} bytes are no "
                       f"complete entry ({_strip(row['message'], path)}); replay cuts them")
        elif kind == "entry":
            self._entry(path, gen, row)

    def _entry(self, path: Path, gen: int, row: dict[str, Any]) -> None:
        self.report.checked["wal_entries"] += 1
        if row["crc"] != "ok" or row["problem"]:
            why = row["problem"] or "crc mismatch"
            self._damage(path, gen, row["offset"], row["bytes"], "wal_corrupt_entry",
                         f"entry of {row['bytes']} bytes: {why}")
            self.skipped += 1
            return
        if row["entry_type"] not in wf.KNOWN_ENTRY_TYPES:
            return
        seq = row["sequence"]
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
                ranges.setdefault(gen, []).append((start, start + _size(p)))
    return ranges


def _check_segment_dir(path: Path, report: Report) -> None:
    if path.name in MARKER_TYPES:
        try:
            read_marker(path, MARKER_TYPES[path.name])
        except CorruptRecord as exc:
            report.add(path, 0, "segment_marker", f"{_why(exc)}; the shard will not start")
        return
    if layout.segment_seq_of(path.name) is None or not path.is_file():
        temp = layout.is_segment_tmp(path.name)
        report.add(path, None, "segment_temp" if temp else "segment_stray",
                   "temp file of a finalize cut short; its bundles are still in the WAL"
                   if temp else "not a segment; startup would quarantine it")
        return
    report.checked["segments"] += 1
    report.checked["segment_bytes"] += _size(path)
    try:
        verify_segment(path)
    except FormatMismatch as exc:
        report.add(path, exc.offset, "segment_format",
                   f"{_why(exc)}; not moved: read it with the build that wrote it")
    except CorruptRecord as exc:
        report.add(path, exc.offset, "segment_corrupt", _why(exc))
    except (pa.ArrowException, ValueError, IndexError, KeyError, OSError) as exc:
        # The checksum held, so these are the bytes a writer meant: a bug, not damage.
        # Moving the file would turn a reader bug into lost bundles, so repair leaves it.
        report.add(path, None, "segment_unreadable",
                   f"checksum ok but reading failed: {exc!r}; not moved by --repair")


def _check_ack_log(path: Path, report: Report) -> None:
    """Replay a copy: acklog's replay cuts torn tails, and checking must not write."""
    report.checked["ack_logs"] += 1
    report.checked["ack_log_bytes"] += _size(path)
    events = _Events()
    with tempfile.TemporaryDirectory(prefix="quiverd-fsck-") as tmp:
        copy = Path(tmp) / path.name
        shutil.copyfile(path, copy)
        try:
            acklog.scan_ack_log(copy, ShardLayout(Path(tmp)).quarantine_dir, log=events)
        except CorruptRecord as exc:
            report.add(path, exc.offset, "ack_log", f"{_why(exc)}; the shard will not start")
            return
    for e in (r for r in events.records if r["event"] == "ack_log_quarantined"):
        torn = e["kind"] == "torn_tail"
        report.add(path, e["offset"], "ack_torn_tail" if torn else "ack_corrupt_record",
                   f"{e['bytes']} bytes: " + ("no complete record; replay cuts them" if torn
                                              else "crc mismatch; replay skips the record"))


def repair_findings(findings: list[Finding]) -> list[dict[str, Any]]:
    """Do what daemon startup does about ``findings``; returns the events of each step."""
    events = _Events()
    wal_shards: set[Path] = set()
    ack_logs: set[Path] = set()
    for f in findings:
        path = Path(f.path)
        if f.kind in _MOVED_KINDS:
            # A sidecar replay ignores anyway: moving it changes nothing but the report.
            move_file(path, layout.shard_of(path).quarantine_dir, reason=f.message, log=events)
        elif f.kind in _WAL_REPLAY_KINDS:
            wal_shards.add(layout.shard_of(path).dir)
        elif f.kind in _ACK_REPLAY_KINDS:
            ack_logs.add(path)
    for shard_dir in sorted(wal_shards):
        shard = ShardLayout(shard_dir)
        try:
            walreplay.replay_wal(shard.wal_dir, shard.quarantine_dir,
                                 cfg_hash=wf.DEFAULT_CFG_HASH, max_entry_bytes=MAX_ENTRY_BYTES,
                                 log=events)
        except QuiverError as exc:
            events.error("wal_repair_refused", shard=str(shard_dir), error=str(exc))
    for path in sorted(ack_logs):
        scan = acklog.scan_ack_log(path, layout.shard_of(path).quarantine_dir, log=events)
        if scan.corrupt_records:
            # The skipped records are in quarantine/; compaction stops replay re-reading them.
            acklog.compact(path, scan.state)
            events.warning("ack_log_compacted", path=str(path))
    return events.records


def _lock(data_dir: Path) -> int:
    """flock LOCK like the daemon does: fsck on a live directory would race its writers."""
    if not data_dir.is_dir():
        raise QuiverError(f"{data_dir} is not a directory",
                          hint="pass the daemon's data_dir (the data_dir key of its config)")
    return lock_data_dir(data_dir, purpose="fsck needs it stopped", record_pid=False,
                         hint="stop the daemon (systemctl stop quiverd), then rerun fsck; "
                              "`quiverd status` shows a live daemon's state")


class _Events:
    """Logger for replay and quarantine calls: keeps warnings and errors as repair records."""

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


class _Progress:
    """``files done/total, bytes`` on one ``\\r`` line; silent unless stderr is a TTY."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.files = self.total_files = self.bytes = self.total_bytes = 0

    def start(self, total_files: int, total_bytes: int) -> None:
        self.files, self.total_files, self.bytes, self.total_bytes = 0, total_files, 0, total_bytes
        self._draw()

    def advance(self, nbytes: int) -> None:
        self.files += 1
        self.bytes += nbytes
        self._draw()

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def _draw(self) -> None:
        if self.stream is None:
            return
        self.stream.write(f"\rfsck: {self.files}/{self.total_files} files, "
                          f"{_human(self.bytes)}/{_human(self.total_bytes)}\033[K")
        self.stream.flush()


def _print_summary(data_dir: Path, report: Report, repairs: list[dict[str, Any]], *,
                   repair: bool) -> None:
    c = report.checked
    print(f"quiverd fsck {data_dir}: {c['shards']} shards, {c['wal_files']} WAL files "
          f"({_human(c['wal_bytes'])}, {c['wal_entries']} live entries), {c['segments']} "
          f"segments ({_human(c['segment_bytes'])}), {c['ack_logs']} ack logs")
    for r in repairs:
        detail = "  ".join(f"{k}={v}" for k, v in r.items() if k not in ("event", "level"))
        print(f"repair  {r['event']}  {detail}")
    for label, items in (("FINDING", report.findings), ("note", report.notes)):
        for f in items:
            where = "" if f.offset is None else f" @ {f.offset}"
            print(f"{label}  {f.kind}  {f.path}{where}: {f.message}")
    if report.unlisted_findings:
        print(f"... and {report.unlisted_findings} more findings not listed")
    total = len(report.findings) + report.unlisted_findings
    after = " after repair" if repair and repairs else ""
    print(f"healthy{after}" if report.healthy else
          f"{total} finding{'s' * (total != 1)}{after}"
          + ("" if repair else "; `quiverd fsck --repair` fixes what daemon startup would"))


def _why(exc: CorruptRecord) -> str:
    return _strip(str(exc), exc.path)


def _strip(message: str, path: Path | str) -> str:
    """Drop the ``<path> at offset <n>: `` a CorruptRecord puts first: findings name both."""
    return re.sub(rf"{re.escape(str(path))} at offset \d+: ", "", message)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exp = min(3, (n.bit_length() - 1) // 10)
    return f"{n / 1024 ** exp:.1f} {('KiB', 'MiB', 'GiB')[exp - 1]}"
