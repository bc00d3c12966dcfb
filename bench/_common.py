"""What quiverd's benchmarks share: payloads, a daemon under test, CPU accounting,
the raw-WAL baseline writer, stats.

Nothing here touches the daemon's internals: it runs ``python -m quiverd serve``
(or ``$QUIVERD_BENCH_SERVE``, e.g. a profiling wrapper) as a subprocess on a fresh
data directory, talks to it over its sockets and reads CPU times from /proc.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from quiverd.kernel.bundle import encode_ipc_stream
from quiverd.kernel.errors import QuiverError
from quiverd.kernel.layout import DataDir
from quiverd.net.admin import request
from quiverd.net.ingest import shard_of
from quiverd.wal import format as walformat

KiB = 1024
MiB = 1024 * KiB
REPO = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 60.0


def make_table(target_bytes: int) -> tuple[pa.Table, bytes]:
    """An int64 + utf8 table whose IPC stream is within 0.5 % of ``target_bytes``.

    Rows are ~40 IPC bytes (8-byte id, 4-byte offset, ~28-byte string); the row
    count is refined until the encoded stream hits the target.
    """
    rows = max(target_bytes // 40, 16)
    for _ in range(8):
        table = _table(rows)
        ipc = encode_ipc_stream(table)
        if abs(len(ipc) - target_bytes) <= target_bytes // 200:
            break
        rows = max(int(rows * target_bytes / len(ipc)), 16)
    return table, ipc


def _table(rows: int) -> pa.Table:
    ids = pa.array(range(rows), pa.int64())
    # Varied but deterministic strings: realistic offsets, nothing a codec could shrink.
    text = pa.array([f"user-{(i * 2654435761) % 10**9:09d}/event-{i % 977:03d}"
                     for i in range(rows)])
    return pa.table({"id": ids, "event": text})


def client_names(producers: int, shards: int, tag: str) -> list[str]:
    """One client name per producer, producer i landing on shard ``i % shards``.

    The daemon routes by a stable hash of the name (``quiverd.net.ingest.shard_of``),
    so names are searched until each lands where wanted: load spreads evenly.
    """
    names = []
    for i in range(producers):
        want = i % shards
        k = 0
        while shard_of(f"bench-{tag}-p{i}-{k}", shards) != want:
            k += 1
        names.append(f"bench-{tag}-p{i}-{k}")
    return names


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..100)."""
    if not sorted_values:
        return math.nan
    rank = max(math.ceil(q / 100 * len(sorted_values)), 1)
    return sorted_values[rank - 1]


def filesystem_of(path: Path) -> str:
    """'<fstype> on <device>' of the mount holding ``path`` (a tmpfs would be a lie)."""
    best, desc = "", "unknown"
    real = str(path.resolve())
    with open("/proc/mounts") as mounts:
        for line in mounts:
            dev, mnt, fstype, *_ = line.split()
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, desc = mnt, f"{fstype} on {dev}"
    return desc


def thread_cpu_s(pid: int) -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds of every thread of ``pid``, by thread id."""
    out: dict[int, tuple[float, float]] = {}
    task_dir = Path(f"/proc/{pid}/task")
    for task in task_dir.iterdir():
        try:
            stat = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # thread ended between listing and reading
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(task.name)] = (int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS)
    return out


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far, every thread included, even threads
    that have already exited (/proc/<pid>/stat utime + stime)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_busy_s() -> float:
    """CPU seconds all cores spent neither idle nor in iowait since boot (/proc/stat)."""
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    idle, iowait = ticks[3], ticks[4]
    return (sum(ticks[:8]) - idle - iowait) / CLOCK_TICKS


def foreign_cpu_s(own_pid: int) -> dict[int, float]:
    """CPU seconds so far of each user-space process that is not ``own_pid`` or its
    child, by pid: another benchmark or test run on the same machine shows up here."""
    out: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == own_pid:
            continue
        try:
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) in (0, 2, own_pid):  # kernel threads, init, our own children
            continue
        out[int(entry.name)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return out


def foreign_delta_s(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU used between snapshots (processes that exited in between are not counted)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


@dataclass
class CpuDelta:
    """Daemon CPU between two snapshots: event-loop (main) thread vs every other thread."""

    main_s: float
    workers_s: float
    sys_s: float  # kernel time of all threads (page-cache copies, fsync submission)

    @property
    def total_s(self) -> float:
        return self.main_s + self.workers_s


def cpu_delta(pid: int, before: dict[int, tuple[float, float]],
              after: dict[int, tuple[float, float]]) -> CpuDelta:
    used = {tid: (u - before.get(tid, (0.0, 0.0))[0], s - before.get(tid, (0.0, 0.0))[1])
            for tid, (u, s) in after.items()}
    main = sum(used.get(pid, (0.0, 0.0)))
    workers = sum(u + s for tid, (u, s) in used.items() if tid != pid)
    return CpuDelta(main_s=main, workers_s=workers, sys_s=sum(s for _, s in used.values()))


def _toml(tables: dict[str, dict[str, Any]]) -> str:
    """Flat TOML: the root table first, then one ``[name]`` per section.

    Values are str, int, float, bool or lists of those; JSON spells all of them
    the way TOML does.
    """
    out: list[str] = []
    for table in sorted(tables, key=lambda t: t != ""):
        if table:
            out.append(f"[{table}]")
        out.extend(f"{k} = {json.dumps(v)}" for k, v in tables[table].items())
    return "\n".join(out) + "\n"


class Daemon:
    """``quiverd serve`` on a fresh data directory; ``stop()`` sends SIGTERM and waits."""

    def __init__(self, root: Path, *, policy: str | None, shards: int,
                 settings: dict[str, Any] | None = None, directory: Path | None = None,
                 tag: str = "") -> None:
        """``settings``: extra config keys by dotted name (``{"wal.flush_bytes": 1}``).
        ``directory``: run on this directory (a second daemon taking over the first one's
        data) instead of a fresh one under ``root``; ``tag`` names its config and log."""
        self.owns_dir = directory is None
        self.dir = Path(tempfile.mkdtemp(prefix="qd-", dir=root)) if directory is None \
            else directory
        self.data_dir = self.dir / "data"
        self.socket = DataDir(self.data_dir).ingest_socket
        self.admin_socket = DataDir(self.data_dir).admin_socket
        suffix = f"-{tag}" if tag else ""
        self.log_path = self.dir / f"daemon{suffix}.log"
        config = self.config_path = self.dir / f"quiverd{suffix}.toml"
        # segment.max_open_duration_ms and every key not set here keep their defaults.
        tables: dict[str, dict[str, Any]] = {
            "": {"data_dir": str(self.data_dir), "shards": shards},
            "log": {"format": "json", "level": "warning"},
        }
        if policy is not None:
            tables["wal"] = {"flush_policy": policy}
        for key, value in (settings or {}).items():
            table, _, name = key.rpartition(".")
            tables.setdefault(table, {})[name] = value
        config.write_text(_toml(tables))
        for stale in (self.socket, self.admin_socket):  # left by a killed daemon
            stale.unlink(missing_ok=True)
        self._log = open(self.log_path, "wb")
        # QUIVERD_BENCH_SERVE replaces `python -m quiverd` (e.g. a profiling wrapper).
        prefix = os.environ.get("QUIVERD_BENCH_SERVE", "").split() or \
            [sys.executable, "-m", "quiverd"]
        self.spawned = time.perf_counter()
        self.proc = subprocess.Popen(
            [*prefix, "serve", "--config", str(config)],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self.pid = self.proc.pid
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            self._log.close()
            if self.owns_dir:
                self.remove()  # the error carries the log's tail
            raise
        self.ready = time.perf_counter()

    def _wait_ready(self) -> None:
        # An external process has no event to wait on: poll its admin socket, bounded.
        # The sockets exist (and listen) from before recovery: ready is the first answer.
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"quiverd exited with {self.proc.returncode} at startup:\n"
                                   + self.log_tail())
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"quiverd not ready after {STARTUP_TIMEOUT_S} s:\n"
                                   + self.log_tail())
            time.sleep(0.02)

    def _answers(self) -> bool:
        if not self.admin_socket.exists():
            return False
        try:
            request(self.admin_socket, "status", timeout_s=0.2)
        except (QuiverError, OSError):  # no answer yet: still recovering
            return False
        return True

    def stop(self) -> int:
        """SIGTERM, wait for the graceful drain; return the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class BaselineWal:
    """The baseline's WAL file: raw ``os.writev`` appends with the daemon's sync cadence.

    ``interval``: fdatasync once ``flush_bytes`` are unsynced or ``flush_interval_s``
    passed since the last sync (checked after each append); ``always``: after each
    append. Appends take a lock (threads share a file as producers share a shard);
    fdatasync runs outside it and covers exactly the appends claimed before it.
    """

    def __init__(self, path: Path, *, policy: str, flush_interval_s: float,
                 flush_bytes: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
        os.write(self.fd, walformat.encode_header(walformat.DEFAULT_CFG_HASH))
        os.fdatasync(self.fd)
        self.policy, self.flush_interval_s, self.flush_bytes = policy, flush_interval_s, flush_bytes
        self.lock = threading.Lock()
        self.unsynced = 0
        self.last_sync = time.perf_counter()
        self.pending: list[float] = []  # write-start times not yet covered by a sync

    def append(self, pieces: list[Any], size: int, latencies: list[float]) -> None:
        t0 = time.perf_counter()
        covered: list[float] | None = None
        with self.lock:
            done = os.writev(self.fd, pieces)
            assert done == size, f"short write {done} < {size}"  # regular file, no signals
            self.pending.append(t0)
            self.unsynced += size
            now = time.perf_counter()
            if self.policy == "always" or self.unsynced >= self.flush_bytes or \
                    now - self.last_sync >= self.flush_interval_s:
                covered, self.pending, self.unsynced, self.last_sync = self.pending, [], 0, now
        if covered:
            self._sync(covered, latencies)

    def close(self, latencies: list[float]) -> None:
        """Sync what is left, then close."""
        with self.lock:
            covered, self.pending = self.pending, []
        self._sync(covered, latencies)
        os.close(self.fd)

    def _sync(self, covered: list[float], latencies: list[float]) -> None:
        os.fdatasync(self.fd)
        now = time.perf_counter()
        latencies.extend(now - t for t in covered)


def git_head() -> str:
    """The short commit the figures were measured at ("" outside a checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent, check=False
                              ).stdout.strip()
    except OSError:
        return ""
