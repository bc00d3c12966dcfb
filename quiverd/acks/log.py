"""ack.log on disk: replay with torn-tail repair, the appender, and compaction.

Layout is in ``quiverd.acks.format``. Every function here blocks: call it from a worker
thread (``anyio.to_thread.run_sync``), one hop per batch.

Life of the file, as the ack_logger actor drives it::

    startup   scan_ack_log()      replay, cutting a torn tail into quarantine/
              compact()           rewrite as one CHECKPOINT (atomic_write)
              AckLogFile.open()
    running   append(records) -> sync() -> AckState.apply(each record)
              when should_compact(threshold): AckLogFile.compact(state)

Replay bound: the file is one CHECKPOINT followed by records appended since, and the
ack_logger compacts as soon as those exceed ``compact_threshold_bytes``. Replay
therefore reads at most ``checkpoint_len + compact_threshold_bytes + one batch``
bytes, whatever the daemon's uptime. ``ScanReport.records_since_checkpoint`` counts
what replay had to apply beyond the checkpoint so tests and metrics can check it.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from quiverd.acks import format as fmt
from quiverd.acks.state import AckState
from quiverd.kernel import fs, layout
from quiverd.kernel.durable import atomic_write, fsync_dir, with_path
from quiverd.kernel.errors import CorruptRecord, DurabilityLost, NoSpace
from quiverd.kernel.faults import Hook, StepTracker
from quiverd.kernel.quarantine import keep_bytes

READ_CHUNK_BYTES = 1024 * 1024


class ScanReport(msgspec.Struct, kw_only=True):
    state: AckState
    valid_end: int  # file size after repair: where appends continue
    records_since_checkpoint: int = 0
    corrupt_records: int = 0  # CRC-damaged records skipped (their successor was valid)
    truncated_bytes: int = 0  # torn tail cut into quarantine
    unknown_records: int = 0  # types from a newer build, skipped by length


def replay_ack_log(path: str | os.PathLike[str], quarantine_dir: str | os.PathLike[str], *,
                   log: Any, max_record_len: int = fmt.DEFAULT_MAX_RECORD_LEN,
                   state: AckState | None = None) -> AckState:
    """Rebuild the shard's AckState from ack.log (an absent file is an empty state)."""
    return scan_ack_log(path, quarantine_dir, log=log, max_record_len=max_record_len,
                        state=state).state


def scan_ack_log(path: str | os.PathLike[str], quarantine_dir: str | os.PathLike[str], *,
                 log: Any, max_record_len: int = fmt.DEFAULT_MAX_RECORD_LEN,
                 state: AckState | None = None) -> ScanReport:
    """Replay like ``replay_ack_log`` and report what was repaired.

    A partial record at the tail (or a length no writer produces) is a torn tail: its
    bytes are copied to ``quarantine_dir`` and the file is truncated to the last good
    record. A complete record with a bad CRC is skipped and quarantined when the record
    after it validates; otherwise it, too, starts the torn tail.
    """
    path = Path(path)
    report = ScanReport(state=state if state is not None else AckState(), valid_end=0)
    if not path.exists() or path.stat().st_size == 0:
        return report  # empty: created on a full disk, header not written yet
    with open(path, "rb") as f:
        fmt.decode_header(f.read(fmt.HEADER_LEN), path=str(path))
        scanner = fmt.RecordScanner(offset=fmt.HEADER_LEN, max_record_len=max_record_len)
        good_end, suspect = fmt.HEADER_LEN, None
        while True:
            item = scanner.next()
            if item is None:
                chunk = f.read(READ_CHUNK_BYTES)
                if chunk:
                    scanner.feed(chunk)
                    continue
                break  # EOF: whatever is still buffered is a partial record
            if isinstance(item, fmt.BadLength):
                break
            if not item.crc_ok:
                if suspect is not None:
                    break  # two bad records in a row: no valid successor, torn tail
                suspect = item
                continue
            if suspect is not None:
                _quarantine(path, quarantine_dir, suspect.offset, suspect.end, "bad_crc", log)
                report.corrupt_records += 1
                suspect = None
            _apply_frame(path, item, report)
            good_end = item.end
    size = path.stat().st_size
    if good_end < size:
        _cut_tail(path, quarantine_dir, good_end, size, log)
        report.truncated_bytes = size - good_end
    report.valid_end = good_end
    log.info("ack_log_replayed", path=str(path), bytes=good_end,
             records_since_checkpoint=report.records_since_checkpoint,
             corrupt_records=report.corrupt_records, truncated_bytes=report.truncated_bytes)
    return report


def _apply_frame(path: Path, frame: fmt.Frame, report: ScanReport) -> None:
    try:
        record = fmt.decode_record(frame.record_type, frame.body)
        if record is None:
            report.unknown_records += 1
            return
        report.state.apply(record)
    except ValueError as exc:
        # The CRC matched, so these bytes are what a writer meant: a bug, not a torn write.
        raise CorruptRecord(str(path), frame.offset, f"record does not apply: {exc}") from exc
    if isinstance(record, fmt.Checkpoint):
        report.records_since_checkpoint = 0
    else:
        report.records_since_checkpoint += 1


def _quarantine(path: Path, quarantine_dir: str | os.PathLike[str], start: int, end: int,
                kind: str, log: Any) -> None:
    """Copy ``path[start:end]`` durably into quarantine before anything is cut or skipped."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    # The timestamp keeps two repairs at the same offset (two crashes) from colliding.
    name = layout.ack_log_quarantine_name(start, kind, time.time_ns())
    target = keep_bytes(data, Path(quarantine_dir), name)
    log.warning("ack_log_quarantined", path=str(path), offset=start, bytes=len(data),
                kind=kind, to=str(target))


def _cut_tail(path: Path, quarantine_dir: str | os.PathLike[str], good_end: int, size: int,
              log: Any) -> None:
    _quarantine(path, quarantine_dir, good_end, size, "torn_tail", log)
    seam = fs.active()
    fd = seam.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        seam.ftruncate(fd, good_end)
        seam.fsync(fd)
    except OSError as exc:
        raise _lost(f"cutting the torn tail of {path}", exc) from with_path(exc, path)
    finally:
        seam.close(fd)
    log.warning("ack_log_truncated", path=str(path), offset=good_end, bytes=size - good_end)


def compact(path: str | os.PathLike[str], state: AckState) -> int:
    """Atomically replace ack.log with its header and one CHECKPOINT; returns the new size.

    ``state`` must include every record in the current file (everything appended has
    been synced and applied), or those records are lost with the old file.
    """
    data = fmt.encode_header() + fmt.encode(state.checkpoint_record())
    steps = StepTracker()
    try:
        return atomic_write(path, data, hook=steps)
    except OSError as exc:
        if steps.reached is not None:
            raise _lost(f"compacting {path} (after step {steps.reached})", exc
                        ) from with_path(exc, path)
        # The temp file was not even written: the old ack.log is untouched and whole.
        fs.active().unlink(layout.tmp_path(Path(path)), missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpace(f"compacting {path}: {exc.strerror}") from exc
        raise  # an ordinary I/O error


def _lost(what: str, exc: OSError) -> DurabilityLost:
    """A failed fsync is never retried: after it the page cache may have dropped the
    dirty pages, and a second fsync could falsely succeed."""
    return DurabilityLost(f"{what} failed: {exc.strerror or exc}; the shard stops")


class AckLogFile:
    """Appender for ack.log. Not thread-safe: one worker hop at a time.

    Every change goes through the seam captured once here (``self._fs``)."""

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self._fs = fs.active()
        self.path = path
        self._fd = fd
        self._size = size
        self._base_size = size  # size right after open/compaction
        self.fault_hook: Hook | None = None  # tests: "acklog.fdatasync=eio@N"

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> AckLogFile:
        """Open for appending, creating the file (atomically, header only) if absent.

        Call after replay, which has already cut any torn tail.
        """
        path = Path(path)
        seam = fs.active()
        if not path.exists() or path.stat().st_size == 0:
            try:
                atomic_write(path, fmt.encode_header())
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # A new shard on a 100 % full disk: an empty file (an inode, no data
                # block) reads as no ack.log; the first append writes the header.
                seam.unlink(layout.tmp_path(path), missing_ok=True)
                seam.close(seam.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
                fsync_dir(path.parent)
        fd = seam.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        return cls(path, fd, os.fstat(fd).st_size)

    @property
    def size(self) -> int:
        return self._size

    @property
    def bytes_since_compaction(self) -> int:
        return self._size - self._base_size

    def should_compact(self, threshold_bytes: int) -> bool:
        return self.bytes_since_compaction >= threshold_bytes

    def append(self, records: list[bytes]) -> int:
        """Write encoded records (not yet durable: call ``sync``); returns bytes written.

        A write that finds no space is cut back to the last whole record (ftruncate) and
        raises NoSpace: the file is as before, and the same records may be written
        again later. A failed cut-back leaves the file unknown: that OSError is fatal.
        """
        if self._size == 0:
            self._write_header()
        try:
            n = fs.write_all(self._fd, records, self._fs)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self._fs.ftruncate(self._fd, self._size)
            raise NoSpace(f"{self.path}: {exc.strerror}") from exc
        self._size += n
        return n

    def _write_header(self) -> None:
        """``open`` found no space for the header: write it now, atomically (a torn
        header would stop the next start), or raise NoSpace like any append."""
        try:
            atomic_write(self.path, fmt.encode_header())
            fd = self._fs.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self._fs.unlink(layout.tmp_path(self.path), missing_ok=True)
            raise NoSpace(f"{self.path}: {exc.strerror}") from exc
        self._fs.close(self._fd)
        self._fd = fd
        self._size = self._base_size = os.fstat(fd).st_size

    def sync(self) -> None:
        """fdatasync. An OSError propagates: the caller must treat it as fatal for the
        shard (DurabilityLost, as the ack_logger does), because after a failed fsync the
        page cache may already have dropped the dirty pages and a retry could falsely
        succeed."""
        if self.fault_hook is not None:
            self.fault_hook("fdatasync")
        self._fs.fdatasync(self._fd)

    def compact(self, state: AckState) -> int:
        """Rewrite the file as one checkpoint and reopen it; returns the new size."""
        self._fs.close(self._fd)
        try:
            size = compact(self.path, state)
        finally:
            # The rename swapped inodes, or (on failure) the old file is intact:
            # either way appends must go to whatever ack.log now is.
            self._fd = self._fs.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self._size = os.fstat(self._fd).st_size
        self._base_size = self._size
        return size

    def close(self) -> None:
        if self._fd >= 0:
            self._fs.close(self._fd)
            self._fd = -1

    def __enter__(self) -> AckLogFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

