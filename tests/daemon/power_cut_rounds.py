"""One power-cut round, shared by tests/daemon/test_power_cut.py and bench/powercut.py.

A round loop-mounts a fresh xfs image, starts a writer on it, cuts power at a random
moment with the ioctl behind ``xfs_io -x -c shutdown`` (XFS_IOC_GOINGDOWN, no log
flush: what was not forced to the log is gone), remounts and checks that every
acknowledged record is still there. Writers (``MODES``):

    quiverd-plain    the daemon, group commit, lake off, no subscriber
    quiverd-gc-lake  the daemon with the lake on (fs store and SQLite catalog on the same
                     image) and a subscriber that acks everything: segments are finalized,
                     uploaded and deleted, WAL space is reclaimed, all during the run
    never            the daemon with ``wal.flush_policy = "never"``: must lose, or the
                     harness could not see a loss
    plain-writer     the control: a plain Python loop (append a record, fdatasync, report
                     the ack only then) on the same kind of image, cut the same way

Every ack carries a ``time.monotonic()`` stamp (CLOCK_MONOTONIC, shared by all
processes), taken after the ack arrived; the cut is stamped right before and right after
the ioctl. Only acks stamped before the cut began must survive: the shutdown is not
instantaneous like a power cut, and an fdatasync that returns while it runs may have
been let through with nothing forced to the log (xfs unpins the aborted log items, so
the fsync finds nothing to force and returns 0). The plain writer lost exactly such
records; a real power cut stops the process before that return. Those losses are
counted apart (``lost_in_cut``). A lossy round keeps its evidence.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from quiverd.client import Client, subscribe
from quiverd.net.admin import request
from quiverd.runtime.serve import EXIT_FATAL
from tests.daemon.helpers import stored_bundles, tagged_table
from tests.daemon.mounts import MiB, mounted_image, remount

IMAGE_BYTES = 320 * MiB  # mkfs.xfs refuses less than 300 MiB; the file is sparse
MODES = ("quiverd-plain", "quiverd-gc-lake", "never", "plain-writer")
BASE = {"shards": 2, "segment.target_size_bytes": 1 * MiB,
        "segment.max_open_duration_ms": 500, "lake.enabled": False}
# Small WAL files and fast segments, files and acks: within a second or two of traffic
# segments are finalized, uploaded, registered, acked by both subscribers and deleted,
# and the WAL rotates and reclaims its head, all before the cut.
GC_LAKE = {"segment.max_open_duration_ms": 150, "wal.max_size_bytes": 16 * MiB,
           "ingest.max_bundle_bytes": 1 * MiB, "wal.max_entry_bytes": 2 * MiB,
           "wal.max_chunks": 8, "lake.enabled": True, "lake.file_duration_ms": 250,
           "lake.janitor.interval_s": 0, "lake.compaction.interval_s": 0}
SETTINGS = {"quiverd-plain": BASE, "never": {**BASE, "wal.flush_policy": "never"},
            "quiverd-gc-lake": {**BASE, **GC_LAKE}}
# Seconds of traffic before the cut, counted from MIN_ACKS acks (and in the GC mode from
# the first segments_deleted).
RUN_S = {"quiverd-plain": (0.4, 1.2), "never": (0.4, 1.2), "quiverd-gc-lake": (0.0, 1.2),
         "plain-writer": (0.4, 1.2)}
# Before that random time, the producers must have this many acks: on a loaded machine a
# fixed sleep from their start sometimes cut before the first ack, testing nothing.
MIN_ACKS = 100
WAIT_TIMEOUT_S = 30.0
GC_EVENTS = ("segment_finalized", "segments_deleted", "wal_rotated", "wal_rewritten",
             "lake_file_metaregistered")
MakeDaemon = Callable[[dict[str, Any], str], Any]
XFS_IOC_GOINGDOWN = 2 << 30 | 4 << 16 | ord("X") << 8 | 125  # _IOR('X', 125, __u32)
GOING_FLAGS = {"logflush": 1, "nologflush": 2}  # xfs_io's "shutdown -f" and "shutdown"


@dataclass
class Round:
    mode: str
    n: int
    acked: int = 0  # acks stamped before the cut began: each must survive
    lost: list[Any] = field(default_factory=list)  # of those, not stored after restart
    acked_in_cut: int = 0  # acks stamped after the ioctl was entered: may be lost
    lost_in_cut: list[Any] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)  # GC_EVENTS logged before the cut
    problems: list[str] = field(default_factory=list)  # the daemon did not stop as documented
    cut_ms: float = 0.0  # how long the shutdown ioctl took
    evidence: Path | None = None

    @property
    def deleted(self) -> bool:
        return self.events.get("segments_deleted", 0) > 0


class Producer(threading.Thread):
    """Pipelines tagged bundles; records each ack (and when it came) until the daemon is gone."""

    def __init__(self, socket: Path, client: str, first_tag: int) -> None:
        super().__init__(daemon=True)
        self.socket, self.client, self.tag = socket, client, first_tag
        self.acked: dict[tuple[int, int], tuple[int, float]] = {}
        self.error: BaseException | None = None  # why it stopped: expected once the cut hit
        self.error_at = 0.0  # monotonic

    def run(self) -> None:
        try:
            with Client.connect(self.socket) as c:
                while True:
                    tags = list(range(self.tag, self.tag + 16))
                    self.tag += 16
                    items = [tagged_table(t, rows=200 + t % 100) for t in tags]
                    for t, ack in zip(tags, c.iter_send(items, client=self.client),
                                      strict=False):
                        self.acked[(ack.shard, ack.sequence)] = (t, time.monotonic())
        except Exception as e:
            self.error, self.error_at = e, time.monotonic()  # the filesystem went down


class Subscriber(threading.Thread):
    """Acks every delivery, so the GC deletes segments once the uploader acked them too."""

    def __init__(self, socket: Path, name: str) -> None:
        super().__init__(daemon=True)
        self.socket, self.name, self.acked = socket, name, 0

    def run(self) -> None:
        async def consume() -> None:
            async with subscribe(self.socket, self.name, window=256) as deliveries:
                async for b in deliveries:
                    await b.ack()
                    self.acked += 1
        try:
            anyio.run(consume)
        except BaseException:
            pass  # the daemon went away


def cut(mountpoint: Path, flush_log: bool = False) -> tuple[float, float]:
    """Power cut: shut the filesystem down, as ``xfs_io -x -c shutdown`` does but in this
    process, so the stamps bracket the ioctl itself rather than a process start.
    Returns the monotonic stamps (entered, returned)."""
    fd = os.open(mountpoint, os.O_RDONLY)
    try:
        flags = GOING_FLAGS["logflush" if flush_log else "nologflush"].to_bytes(4, "little")
        t0 = time.monotonic()
        fcntl.ioctl(fd, XFS_IOC_GOINGDOWN, flags)
        return t0, time.monotonic()
    finally:
        os.close(fd)


def split(r: Round, acked: dict[Any, float], present: Any, t_cut: tuple[float, float]) -> None:
    """Acks before the cut began must be ``present``; the ones stamped during or after it
    are counted apart (see the module doc)."""
    before = [k for k, t in acked.items() if t < t_cut[0]]
    r.acked, r.acked_in_cut = len(before), len(acked) - len(before)
    r.lost = sorted(k for k in before if k not in present)
    r.lost_in_cut = sorted(k for k, t in acked.items() if t >= t_cut[0] and k not in present)
    r.cut_ms = round((t_cut[1] - t_cut[0]) * 1000, 3)


def quiverd_round(make: MakeDaemon, work: Path, mode: str, n: int, run_s: float,
                  keep: Path | None, flush_log: bool = False,
                  settings: dict[str, Any] | None = None) -> Round:
    """One daemon round in ``mode``: the daemon must stop the documented way (exit 70,
    ``quiverd_fatal_durability``, no traceback), and after a restart every acked
    bundle must be stored once: in a segment, or (GC mode) in a registered lake file.
    ``settings`` overrides config keys of the mode."""
    d = make({**SETTINGS[mode], **(settings or {})}, f"{mode}{n}")
    image, out = work / f"{mode}{n}.img", Round(mode, n)
    try:
        with mounted_image(d.data_dir, image, "xfs", IMAGE_BYTES):
            d.start()
            sub = None
            if mode == "quiverd-gc-lake":
                request(d.admin_socket, "subscribers.add", {"name": "sub", "start": "earliest"})
                sub = Subscriber(d.socket, "sub")
                sub.start()
            producers = [Producer(d.socket, f"p{i}", (n * 10 + i) * 1_000_000)
                         for i in range(2)]
            for p in producers:
                p.start()
            wait_until(lambda: sum(len(p.acked) for p in producers) >= MIN_ACKS, "acks", d.log)
            if sub is not None:  # GC mode: segments acked by both subscribers, deleted
                wait_until(lambda: bool(d.events("segments_deleted")), "deletion", d.log)
            time.sleep(run_s)
            t_cut = cut(d.data_dir, flush_log)
            early = [repr(p.error) for p in producers
                     if p.error is not None and p.error_at < t_cut[0]]
            assert not early, f"a producer stopped before the cut: {early}"
            out.problems = stopped_as_documented(d)
            for t in [*producers, *([sub] if sub else [])]:
                t.join(10)
            out.events = {e: len(d.events(e)) for e in GC_EVENTS}
            remount(d.data_dir, image, "xfs")
            before = work / f"{mode}{n}-before-recovery"  # what the cut left, pre-recovery
            shutil.copytree(d.data_dir, before)
            d.start()
            assert d.stop() == 0, d.log()[-3000:]
            acked = {k: v for p in producers for k, v in p.acked.items()}
            gone = set(missing(d, acked, lake=mode == "quiverd-gc-lake"))
            split(out, {k: t for k, (_, t) in acked.items()},
                  {k for k in acked if k not in gone}, t_cut)
            if (out.lost or out.lost_in_cut or out.problems) and keep is not None:
                out.evidence = keep_evidence(keep, d, out, acked, t_cut, before)
            shutil.rmtree(before, ignore_errors=True)
            return out
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.kill()
        image.unlink(missing_ok=True)


def wait_until(done: Callable[[], bool], what: str, log: Callable[[], str]) -> None:
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while not done():
        assert time.monotonic() < deadline, f"no {what} in {WAIT_TIMEOUT_S} s:\n{log()[-3000:]}"
        time.sleep(0.02)


def stopped_as_documented(d: Any) -> list[str]:
    """What is wrong with how the daemon stopped: it must exit 70 with
    ``quiverd_fatal_durability`` logged and no traceback. A daemon still running on a
    dead filesystem is killed and the round fails."""
    try:
        code = d.wait(20)
    except subprocess.TimeoutExpired:
        d.kill()
        raise AssertionError(f"the daemon kept running on a dead filesystem:\n"
                             f"{d.log()[-3000:]}") from None
    log = d.log()
    problems = [] if code == EXIT_FATAL else [f"exit code {code}, not {EXIT_FATAL}"]
    if not d.events("quiverd_fatal_durability"):
        problems.append("no quiverd_fatal_durability event")
    if "Traceback" in log:
        at = log.index("Traceback")
        problems.append("traceback in the log: " + log[at:at + 1500].strip().replace("\n", " | "))
    return problems


def missing(d: Any, acked: dict[tuple[int, int], tuple[int, float]],
            lake: bool) -> list[tuple[int, int]]:
    """Acked bundles stored nowhere; the stored ones must hold what was sent. With the lake
    on, a bundle whose segment was deleted must be in a registered lake file."""
    stored = stored_bundles(d.data_dir)  # asserts no bundle is stored twice
    for key, (tag, _) in acked.items():
        if key in stored:
            assert stored[key].slots[0].equals(tagged_table(tag, rows=200 + tag % 100)), key
    in_lake = lake_tags(d) if lake else set()
    return [k for k, (tag, _) in acked.items() if k not in stored and tag not in in_lake]


def lake_tags(d: Any) -> set[int]:
    from tests.daemon.lake_helpers import read_object, registered_rows  # needs the lake deps

    tags: set[int] = set()
    for row in registered_rows(d):
        if "tag" in (t := read_object(row)).column_names:
            tags.update(t.column("tag").to_pylist())
    return tags


def keep_evidence(keep: Path, d: Any, r: Round, acked: dict[tuple[int, int], tuple[int, float]],
                  t_cut: tuple[float, float], before: Path) -> Path:
    """Keep what a lossy round left: acks with times relative to the cut (ms, negative =
    before xfs_io was spawned), the daemon log, the data dir before and after recovery."""
    where = keep / f"{r.mode}{r.n}"
    where.mkdir(parents=True, exist_ok=True)
    acks = sorted([*k, tag, round((t - t_cut[0]) * 1000, 3)] for k, (tag, t) in acked.items())
    (where / "acked.json").write_text(json.dumps(
        {"cut_ioctl_ms": r.cut_ms, "problems": r.problems,
         "columns": ["shard", "sequence", "tag", "ack_ms_from_cut"], "acked": acks,
         "lost": [list(k) for k in r.lost], "lost_in_cut": [list(k) for k in r.lost_in_cut]}))
    shutil.copy(d.log_path, where / "daemon.log")
    shutil.copytree(before, where / "data-before-recovery", dirs_exist_ok=True)
    shutil.copytree(d.data_dir, where / "data-after", dirs_exist_ok=True)
    return where


# ---- the plain-writer control ---------------------------------------------------------

RECORD_BYTES = 4096
RECORD = struct.Struct("<QQ")  # sequence, monotonic ns when written; payload; CRC-32 last
WRITER = """
import os, struct, sys, time, zlib
path, size = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
os.fsync(fd)
dfd = os.open(os.path.dirname(path), os.O_RDONLY)
os.fsync(dfd)  # the file itself exists durably before the first record
os.write(1, b"ready\\n")
seq = 0
while True:
    body = struct.pack("<QQ", seq, time.monotonic_ns())
    body += bytes([seq % 251]) * (size - len(body) - 4)
    try:
        os.write(fd, body + struct.pack("<I", zlib.crc32(body)))
        entered = time.monotonic_ns()
        os.fdatasync(fd)
    except OSError:
        break
    os.write(1, b"%d %d %d\\n" % (seq, entered, time.monotonic_ns()))  # acked only now
    seq += 1
"""


def writer_round(work: Path, n: int, run_s: float, keep: Path | None,
                 flush_log: bool = False) -> Round:
    """The control: append + fdatasync in a plain loop, cut, remount, count what is gone."""
    mnt, image, out = work / f"writer{n}", work / f"writer{n}.img", Round("plain-writer", n)
    try:
        with mounted_image(mnt, image, "xfs", IMAGE_BYTES):
            proc = subprocess.Popen([sys.executable, "-c", WRITER, str(mnt / "log"),
                                     str(RECORD_BYTES)], stdout=subprocess.PIPE)
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
            lines: list[bytes] = []  # drained all along: a full pipe would stall the writer
            drain = threading.Thread(target=lambda: lines.extend(proc.stdout or []))
            drain.start()
            wait_until(lambda: len(lines) >= MIN_ACKS, "acks", lambda: "")
            time.sleep(run_s)
            t_cut = cut(mnt, flush_log)
            proc.wait(20)
            drain.join(10)
            proc.stdout.close()
            stamps = [[int(x) for x in line.split()] for line in lines]  # seq, sync called, ack
            acked = {s: t / 1e9 for s, _, t in stamps}
            remount(mnt, image, "xfs")
            present = intact_records(mnt / "log")
            split(out, acked, present, t_cut)
            if (out.lost or out.lost_in_cut) and keep is not None:
                out.evidence = keep / f"plain-writer{n}"
                out.evidence.mkdir(parents=True, exist_ok=True)
                (out.evidence / "acked.json").write_text(json.dumps({
                    "cut_ioctl_ms": out.cut_ms,
                    "columns": ["sequence", "fdatasync_called_ms_from_cut", "ack_ms_from_cut"],
                    "acked": [[s, round(e / 1e6 - t_cut[0] * 1000, 3),
                               round(t / 1e6 - t_cut[0] * 1000, 3)] for s, e, t in stamps],
                    "lost": out.lost, "lost_in_cut": out.lost_in_cut,
                    "present": len(present)}))
                shutil.copy(mnt / "log", out.evidence / "log")
            return out
    finally:
        image.unlink(missing_ok=True)


def intact_records(path: Path) -> set[int]:
    """Sequences of the records that read back whole and in order from the start."""
    data = path.read_bytes() if path.exists() else b""
    out: set[int] = set()
    for i in range(len(data) // RECORD_BYTES):
        rec = data[i * RECORD_BYTES:(i + 1) * RECORD_BYTES]
        seq, _ = RECORD.unpack_from(rec)
        if seq != i or zlib.crc32(rec[:-4]) != struct.unpack_from("<I", rec, len(rec) - 4)[0]:
            break
        out.add(seq)
    return out
