"""``quiverd fsck DATA_DIR [--repair] [--json]``: verify a stopped daemon's data directory.

The checks, one per file of every ``shard-<n>/``, are in ``fsck_checks``. Checking
never writes (LOCK is created if absent, to flock it). ``--repair`` does what daemon
startup would do, then checks again: bad segments and temp files move to
``quarantine/``, WAL replay copies damage there (skipping it, or cutting a torn
tail), ack.log replay does the same (plus a compaction that drops records it
copied). Nothing is deleted. Damage replay already copied to quarantine but still
skips is a note, not a finding: it no longer needs a repair.

Loss is reported apart from damage: acknowledged bundles that no segment, WAL entry or
DELETED marker holds any more (a WAL entry skipped as damage, the bundles of a
quarantined segment the WAL had already released), as WAL sequence ranges and, for a
gone segment ack.log knows, its bundle ids. Repair cannot bring them back.

A directory that holds neither LOCK nor a ``shard-<n>/`` directory is refused before
anything is created in it.

Exit status: 0 healthy, or every finding repaired with nothing lost; 1 findings
remain, or acknowledged bundles are lost (``LOST`` lines, also after ``--repair``:
loss cannot be repaired), or fsck refused to run (not a data directory, in use;
message and ``hint:`` on stderr).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import msgspec

from quiverd.acks import log as acklog
from quiverd.cli.fsck_checks import (
    EventLog,
    Finding,
    Report,
    ShardFacts,
    ShardLoss,
    file_size,
    plan_shard,
)
from quiverd.kernel import layout
from quiverd.kernel.errors import QuiverError
from quiverd.kernel.layout import ShardLayout
from quiverd.kernel.quarantine import move_file
from quiverd.runtime.lockfile import is_data_dir, lock_data_dir
from quiverd.wal import format as wf
from quiverd.wal import replay as walreplay

# fsck has no config: accept any length a u32 allows, so a repair never cuts an
# entry a daemon with a large ``wal.max_entry_bytes`` would keep.
MAX_ENTRY_BYTES = wf.MAX_ENTRY_LEN
_MOVED_KINDS = frozenset({"segment_corrupt", "segment_temp", "segment_stray", "wal_sidecar"})
_WAL_REPLAY_KINDS = frozenset({"wal_torn_tail", "wal_corrupt_entry", "wal_damage"})
_ACK_REPLAY_KINDS = frozenset({"ack_torn_tail", "ack_corrupt_record"})

EXIT_HEALTHY = 0  # nothing found, or every finding repaired and nothing acknowledged lost
EXIT_UNHEALTHY = 1  # findings remain, or acknowledged bundles are lost (listed as LOST)


def run_fsck(data_dir: Path, *, repair: bool, as_json: bool) -> int:
    """Check ``data_dir`` (and repair it); 0 when healthy, 1 with findings or loss."""
    lock_fd = _lock(data_dir)
    try:
        shards = shard_dirs(data_dir)
        progress = _Progress(sys.stderr if sys.stderr.isatty() else None)
        report, facts = check_data_dir(shards, progress)
        repairs: list[dict[str, Any]] = []
        if repair and (report.findings or report.unlisted_findings):
            repairs = repair_findings(report.findings, {f.shard.dir: f for f in facts})
            report, _ = check_data_dir(shards, progress)
        if as_json:
            out = {"healthy": report.healthy, **msgspec.to_builtins(report),
                   **({"repairs": repairs} if repair else {})}
            print(json.dumps(out, default=str))
        else:
            _print_summary(data_dir, report, repairs, repair=repair)
        return EXIT_HEALTHY if report.healthy else EXIT_UNHEALTHY
    finally:
        os.close(lock_fd)


def shard_dirs(data_dir: Path) -> list[Path]:
    found = {i: p for p in data_dir.iterdir()
             if p.is_dir() and (i := layout.shard_index(p.name)) is not None}
    return [found[i] for i in sorted(found)]


def check_data_dir(shards: list[Path], progress: _Progress) -> tuple[Report, list[ShardFacts]]:
    """Read-only check of every shard; findings say what replay or startup would hit."""
    report = Report()
    facts = [ShardFacts(shard) for shard in shards]
    work = [item for f in facts for item in plan_shard(f, report)]
    sizes = [file_size(path) for path, _ in work]
    progress.start(len(work), sum(sizes))
    for (_, check), size in zip(work, sizes, strict=True):
        check()
        progress.advance(size)
    progress.finish()
    report.checked["shards"] = len(shards)
    for f in facts:
        loss = f.loss()
        if loss is None:
            report.add(f.shard.dir, None, "loss_unknown", f"loss not assessed: {f.unknowable}",
                       note=True)
        else:
            new, known = f.new_and_known(loss, report)
            if new.sequences or new.bundles:
                report.lost.append(new)
            if known.sequences or known.bundles:
                report.known_lost.append(known)
    return report, facts


def repair_findings(findings: list[Finding],
                    facts: dict[Path, ShardFacts] | None = None) -> list[dict[str, Any]]:
    """Do what daemon startup does about ``findings``; returns the events of each step.

    ``facts`` (from the check) tell WAL replay which skipped sequences segments hold.
    """
    events = EventLog()
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
        known = (facts or {}).get(shard_dir)
        try:
            walreplay.replay_wal(shard.wal_dir, shard.quarantine_dir,
                                 cfg_hash=wf.DEFAULT_CFG_HASH, max_entry_bytes=MAX_ENTRY_BYTES,
                                 log=events, covered=known.coverage() if known else None)
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
    """flock LOCK like the daemon does: fsck on a live directory would race its writers.

    Refused before anything is created: a directory with neither LOCK nor a shard
    directory is no data directory (a typo, a parent, a fresh mount).
    """
    if not data_dir.is_dir():
        raise QuiverError(f"{data_dir} is not a directory",
                          hint="pass the daemon's data_dir (the data_dir key of its config)")
    if not is_data_dir(data_dir):
        raise QuiverError(f"{data_dir} is not a quiverd data directory: it holds neither "
                          f"{layout.LOCK} nor any {layout.SHARD_PREFIX}<n>/ directory; "
                          "nothing was checked or written",
                          hint="pass the daemon's data_dir (the data_dir key of its config), "
                          "the directory that holds LOCK and shard-0/")
    return lock_data_dir(data_dir, purpose="fsck needs it stopped", record_pid=False,
                         hint="stop the daemon (systemctl stop quiverd), then rerun fsck; "
                              "`quiverd status` shows a live daemon's state")


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
    for loss in report.lost:
        for line in _loss_lines(loss):
            print(line)
    for loss in report.known_lost:
        for line in _loss_lines(loss):
            print(line.replace("LOST ", "KNOWN", 1) + " (reported at an earlier start)")
    total = len(report.findings) + report.unlisted_findings
    after = " after repair" if repair and repairs else ""
    if report.healthy:
        print(f"healthy{after}")
        return
    parts = [f"{total} finding{'s' * (total != 1)}{after}"
             + ("" if repair else "; `quiverd fsck --repair` fixes what daemon startup would")
             ] if total else []
    lost = sum(x.count for x in report.lost)
    if report.lost:
        parts.append(f"{lost} acknowledged bundle{'s' * (lost != 1)} lost{after} (LOST "
                     "above): no repair brings them back, resend them from their source")
    print("; ".join(parts))


def _loss_lines(loss: ShardLoss) -> list[str]:
    """``LOST`` lines: WAL sequence ranges (what producers' acks name) and bundle ids."""
    ranges = ", ".join(f"{lo}" if lo == hi else f"{lo}..{hi}" for lo, hi in loss.sequences)
    lines = [f"LOST  shard {loss.shard}: WAL sequences {ranges} ({loss.count} bundles): "
             "no segment and no WAL entry holds them"] if loss.sequences else []
    for seg in loss.bundles:
        n = seg.bundle_count
        ids = f"bundles ({loss.shard}, {seg.segment_seq}, 0..{n - 1})" if n else \
            "bundle count unknown (ack.log never recorded it)"
        lines.append(f"LOST  shard {loss.shard}: segment {seg.segment_seq}: {ids}; "
                     "its segment was quarantined and the WAL no longer holds them")
    return lines


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exp = min(3, (n.bit_length() - 1) // 10)
    return f"{n / 1024 ** exp:.1f} {('KiB', 'MiB', 'GiB')[exp - 1]}"
