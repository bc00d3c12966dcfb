"""A shard's segments directory on disk: segment files and their two markers.

    segments/<seq:016>.qseg   written once (tmp → fsync → rename → fsync dir → 0440),
                              then its cached pages are given back (``drop_cached_pages``)
    segments/FLOOR            {"segment_seq": N}   highest segment seq ever finalized
                              (finalizer): numbers never repeat, even after every
                              segment is deleted
    segments/DELETED          {"wal_sequence": S, "segment_seqs": [..]}  WAL sequences
                              <= S were in segments deleted on purpose (gc): replay must
                              not resurrect them; segment_seqs is the latest deletion
                              batch, whose SEGMENT_DELETED records a crash may have cut
                              off: recovery and fsck take those files for deleted, not lost

Paths come from ``quiverd.kernel.layout``. Every function blocks: call it from a
worker thread.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pyarrow.compute as pc

from quiverd.kernel import fs, layout
from quiverd.kernel.durable import atomic_write, fsync_dir, with_path
from quiverd.kernel.errors import CorruptRecord, DurabilityLost, QuiverError
from quiverd.kernel.faults import Hook, StepTracker, prefixed
from quiverd.kernel.layout import ShardLayout
from quiverd.kernel.quarantine import move_file
from quiverd.segments.format import SEGMENT_MODE, Piece
from quiverd.segments.reader import SegmentReader, read_manifest
from quiverd.segments.table import SegmentInfo

T = TypeVar("T", bound=msgspec.Struct)
# Directory + manifest + footer of a 32 MiB segment of 128 bundles: ~150 KiB.
TAIL_AHEAD_BYTES = 192 * 1024


class Floor(msgspec.Struct, frozen=True, kw_only=True):
    segment_seq: int = 0


class Deleted(msgspec.Struct, frozen=True, kw_only=True):
    wal_sequence: int = 0
    # The batch being deleted when this marker was written (absent in markers written
    # before this field existed: read as empty). ack.log records the batch's
    # SEGMENT_DELETED before the gc writes the next marker, so one batch is enough.
    segment_seqs: list[int] = msgspec.field(default_factory=list)


MARKER_TYPES: dict[str, type[Floor] | type[Deleted]] = {layout.FLOOR: Floor,
                                                        layout.DELETED: Deleted}


class NotWritten(QuiverError):
    """A crash-safe write failed before its rename: only its temp file was touched,
    and that is removed. Nothing changed on disk; the same write may be tried again."""

    retryable = True
    hint = ("the WAL still holds every bundle of the segment: it is written again with "
            "backoff; free disk space or check the disk (dmesg)")

    def __init__(self, path: Path, exc: OSError) -> None:
        self.errno = exc.errno
        self.no_space = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        super().__init__(f"writing {path} failed: {exc.strerror or exc}")


def write_segment(path: Path, pieces: list[Piece], *, hook: object = None,
                  reserve_bytes: int = 0) -> int:
    """Write ``pieces`` durably as ``path``, read-only (0440); returns bytes written.

    Refuses (ENOSPC) to leave less than ``reserve_bytes`` free on the filesystem.
    Raises NotWritten for a failure before the rename (the temp file is removed: try
    again), DurabilityLost for one after it (the directory fsync: state unknown).
    """
    size = checked_write(path, pieces, mode=SEGMENT_MODE, hook=hook,
                         reserve_bytes=reserve_bytes)
    drop_cached_pages(path)
    return size


def drop_cached_pages(path: Path) -> None:
    """Hand a durable file's page-cache pages back to the kernel (advisory, best effort).

    A segment is written once and read later (subscribers, uploader, scrubber), if at
    all. Left cached, every segment takes pages the VM has not touched lately, and
    writing into those costs ≈ 3.7 µs per 4 KiB (shared/NOTES.md): 32 MiB segments
    wrote at 0.55–0.67 GB/s, and at 3.3 GB/s into the pages the previous segment gave
    back (1.2–1.3 GB/s instead of 0.4–0.5 with the fsync). Reading a segment back from
    the disk runs at ≈ 1.1–1.3 GB/s here. The pages are clean (fsynced), so nothing
    is written by this.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass  # only advice: the file is durable either way
    finally:
        os.close(fd)


def checked_write(path: Path, chunks: list[Piece] | bytes, *, mode: int, hook: object = None,
                  reserve_bytes: int = 0) -> int:
    """``atomic_write`` whose failures say whether a retry is safe (``write_segment``)."""
    steps = StepTracker(hook)  # type: ignore[arg-type]
    try:
        if reserve_bytes > 0:
            parts = [chunks] if isinstance(chunks, bytes) else chunks
            size = sum(memoryview(p).nbytes for p in parts)
            st = os.statvfs(path.parent)
            if st.f_bavail * st.f_frsize - size < reserve_bytes:
                raise OSError(errno.ENOSPC, f"writing {size} bytes would leave less than the "
                              f"{reserve_bytes} kept free for the WAL's metadata and ack.log")
        return atomic_write(path, chunks, mode=mode, hook=steps)
    except OSError as exc:
        if steps.renamed:
            raise DurabilityLost(f"{path} was renamed into place but the fsync of "
                                 f"{path.parent} failed: {exc.strerror or exc}; whether it "
                                 "is durable is unknown, the shard stops"
                                 ) from with_path(exc, path)
        try:
            fs.active().unlink(layout.tmp_path(path), missing_ok=True)
        except OSError as cleanup:
            raise DurabilityLost(f"removing {layout.tmp_path(path)} after a failed write "
                                 f"failed: {cleanup.strerror or cleanup}"
                                 ) from with_path(cleanup, layout.tmp_path(path))
        raise NotWritten(path, exc) from exc


def read_marker(path: Path, kind: type[T]) -> T:
    """Read a marker; a missing file is the zero marker."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=kind)
    except FileNotFoundError:
        return kind()
    except (msgspec.DecodeError, OSError) as exc:
        raise CorruptRecord(str(path), 0, f"marker unreadable: {exc}",
                            hint="restore it from backup, or delete it after checking "
                            "that no higher segment numbers were ever used") from exc


def write_marker(path: Path, marker: msgspec.Struct) -> None:
    atomic_write(path, msgspec.json.encode(marker))


def delete_segments(shard: ShardLayout, segments: Iterable[SegmentInfo], *,
                    hook: Hook | None = None, mark: bool = True) -> int:
    """Unlink a batch of segments durably: one DELETED marker write, one directory fsync.

    The marker rises first (to the highest WAL sequence in the batch) and names the
    batch, so a crash after any unlink can neither bring their bundles back from the
    WAL nor make them look lost. ``mark=False`` for segments ack.log already recorded
    deleted (recovery's orphans). Returns how many files were unlinked (a file
    already gone is not an error). Raises NotWritten when the marker could not be
    written (no space: nothing was unlinked, try again later), DurabilityLost when
    its rename or the directory fsync failed. ``hook`` gets ``marker_<atomic step>``,
    ``unlinked_first``, ``unlinked`` and ``dir_fsynced`` (crash tests).
    """
    batch = list(segments)
    if not batch:
        return 0
    if mark:
        old = read_marker(shard.deleted, Deleted)
        marker = Deleted(wal_sequence=max(old.wal_sequence, *(s.last_sequence for s in batch)),
                         segment_seqs=sorted(s.segment_seq for s in batch))
        checked_write(shard.deleted, msgspec.json.encode(marker), mode=0o644,
                      hook=prefixed(hook, "marker_"))
    unlinked = 0
    seam = fs.active()
    for seg in batch:
        try:
            seam.unlink(seg.path)
            unlinked += 1
        except FileNotFoundError:
            pass
        if unlinked == 1:
            _step(hook, "unlinked_first")
    _step(hook, "unlinked")
    try:
        fsync_dir(shard.segments_dir)
    except OSError as exc:
        raise DurabilityLost(f"fsync of {shard.segments_dir} after unlinking segments failed: "
                             f"{exc.strerror or exc}; the shard stops"
                             ) from with_path(exc, shard.segments_dir)
    _step(hook, "dir_fsynced")
    return unlinked


def _step(hook: Hook | None, step: str) -> None:
    if hook is not None:
        hook(step)


class SegmentScan(msgspec.Struct, kw_only=True):
    good: list[SegmentInfo]  # sorted by segment_seq
    quarantined: list[int]  # segment_seq of each file moved to quarantine/
    # Good segments only their metadata vouches for so far (format version 2, opened
    # with full=False): the whole-file CRC is still to run (first read, scrubber).
    unverified: set[int]


def scan_segments(shard: ShardLayout, log: Any, *, full: bool = False) -> SegmentScan:
    """Check every segment of a shard; quarantine bad ones and leftover temp files.

    ``full=False`` reads a version 2 segment's trailer, footer, directory and
    manifest only (its metadata CRC): O(segments) bytes, however much is retained.
    Version 1 files, and segments holding a transactional end marker (its rows are
    read for the staging table), get the whole-file CRC as well.
    """
    good: list[SegmentInfo] = []
    quarantined: list[int] = []
    unverified: set[int] = set()
    paths = sorted(shard.segments_dir.iterdir())
    if not full:
        _read_tails_ahead(paths)
    for path in paths:
        if layout.is_marker(path.name):
            continue
        seq = layout.segment_seq_of(path.name)
        if seq is None:
            # A *.qseg.tmp is a finalize cut short: its bundles are still in the WAL.
            move_file(path, shard.quarantine_dir, reason="incomplete temp file", log=log)
            continue
        try:
            info, checked = _scan_one(path, seq, full)
            good.append(info)
            if not checked:
                unverified.add(seq)
        except CorruptRecord as exc:
            quarantine_segment(shard, path, exc, log)
            quarantined.append(seq)
    return SegmentScan(good=good, quarantined=quarantined, unverified=unverified)


def _scan_one(path: Path, seq: int, full: bool) -> tuple[SegmentInfo, bool]:
    """A segment's table row from its footer and manifest; whether every byte was checked.

    Only a segment with transactional bundles is opened whole (their tags, and an end
    marker's rows, which ``SegmentReader.staged`` reads from the stream bytes)."""
    _, manifest, checked = read_manifest(path, full=full)
    if manifest.column("txn").null_count == manifest.num_rows:
        seqs = pc.min_max(manifest.column("sequence")).as_py()
        ts = pc.min_max(manifest.column("ingestion_ts")).as_py()
        if manifest.num_rows == 0:
            raise CorruptRecord(str(path), 0, "bad manifest: no bundles")
        return SegmentInfo(segment_seq=seq, path=path, size_bytes=path.stat().st_size,
                           bundle_count=manifest.num_rows, first_sequence=seqs["min"],
                           last_sequence=seqs["max"], min_ts_ns=ts["min"],
                           max_ts_ns=ts["max"]), checked
    with SegmentReader.open(path, full=full, prefetch=full) as reader:
        if reader.has_end_markers():
            reader.check_file_crc()
        return segment_info(path, seq, reader), reader.fully_checked


def _read_tails_ahead(paths: list[Path]) -> None:
    """Queue the reads of every segment's last TAIL_AHEAD_BYTES at once (async
    readahead), so that a cold disk serves them in parallel rather than one
    segment's metadata after another's."""
    for path in paths:
        if layout.segment_seq_of(path.name) is None:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # the scan itself says what is wrong with it
        try:
            size = os.fstat(fd).st_size
            start = max(0, size - TAIL_AHEAD_BYTES)
            os.posix_fadvise(fd, start, size - start, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def verify_file(path: Path) -> None:
    """The whole-file CRC of a segment (reads every byte); raises CorruptRecord."""
    with SegmentReader.open(path, full=True):
        pass


def quarantine_segment(shard: ShardLayout, path: Path, error: object, log: Any) -> Path:
    """Move a segment that failed a check into quarantine/, durably, and say so."""
    log.error("segment_quarantined", path=str(path), error=str(error))
    return move_file(path, shard.quarantine_dir, reason=str(error), log=log)


def segment_info(path: Path, segment_seq: int, reader: SegmentReader) -> SegmentInfo:
    manifest = reader.manifest
    seqs = manifest.column("sequence").to_pylist()
    ts = manifest.column("ingestion_ts").to_pylist()
    return SegmentInfo(segment_seq=segment_seq, path=path, size_bytes=path.stat().st_size,
                       bundle_count=len(seqs), first_sequence=min(seqs),
                       last_sequence=max(seqs), min_ts_ns=min(ts), max_ts_ns=max(ts),
                       staged=reader.staged())
