"""The lake uploader (finalized bundles -> Parquet -> object store -> catalog, then ack)
against writing the same tables with plain pyarrow.

    python bench/lake.py [--quick] [--json out.json] [--repeat N] [--rate-mbps X]
                         [--logs DIR] [--profile DIR]

throughput  per client count (1, 4), ``--repeat`` uploader/baseline pairs:
            uploader   a daemon with ``lake.enabled = false`` receives every bundle (no
                       subscriber is registered, so nothing is deleted) and stops; the
                       same data directory restarts with the lake on, and the built-in
                       subscriber ``uploader`` (registered at start, "earliest") converts
                       the whole backlog. Timed: "ready" (admin answers) -> every bundle in a
                       registered file (``uploader`` lag 0 and lake rows == rows sent).
            pyarrow    the same tables (from the same IPC bytes) through
                       ``pq.ParquetWriter`` with the uploader's settings, into as many
                       files per client as the uploader made, row groups of 64 bundles,
                       one task per client on ``PARALLELISM`` threads, fsync of every
                       file and the directory. Also written once more with the uploader's
                       column layout (dictionaries decoded, its four bundle columns added).
sustained   a fresh daemon with the lake on; one producer at a fixed rate (60 % of the
            single-client uploader rate, or ``--rate-mbps``); once a second: MB sent, the
            uploader's lag, files uploaded; then the time the lag takes to drain.

A file that never reaches ``lake.file_size_bytes`` (the tail of every client) is rotated
by ``lake.file_duration_ms`` only; the seconds the uploader spends doing nothing but
wait for that timer are measured (daemon CPU idle while every bundle is delivered and
no upload is pending) and reported apart: "busy" time = wall time - that wait. Idle
time with bundles still undelivered is not subtracted: it is the product's, and the
per-run line flags it (STARVED).

See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    CLOCK_TICKS,
    STARTUP_TIMEOUT_S,
    Daemon,
    MiB,
    client_names,
    cpu_delta,
    filesystem_of,
    foreign_cpu_s,
    foreign_delta_s,
    git_head,
    machine_busy_s,
    thread_cpu_s,
)

from quiverd.client.producer import Client  # noqa: E402
from quiverd.kernel.bundle import encode_ipc_stream  # noqa: E402
from quiverd.kernel.errors import QuiverError  # noqa: E402
from quiverd.net.admin import request as admin_request  # noqa: E402

SHARDS = 2
CLIENTS = (1, 4)
BUNDLE_BYTES = 1 * MiB
VOLUME_BYTES = 512 * MiB  # Arrow IPC per throughput run (--quick: / 8)
POOL = 64  # distinct bundles, cycled (pages compress independently: no gain from repeats)
SEED = 20261122
# The uploader's settings, and the baseline's.
COMPRESSION_LEVEL = 3
ROW_GROUP_BYTES = 64 * MiB
ROW_GROUP_ROWS = 1 << 20  # ParquetSettings.row_group_rows: the uploader's cap per row group
FILE_SIZE_BYTES = 64 * MiB
# A 64 MiB file holds ~320 MiB of these logs: 2-4 s of conversion, well inside this.
FILE_DURATION_MS = 10_000
PARALLELISM = 2
SUSTAINED_S = 20.0
RATE_FRACTION = 0.6  # sustained rate: this much of the single-client uploader rate
POLL_S = 0.1  # admin `status` costs the daemon ~1 ms of event loop per poll
RUN_TIMEOUT_S = float(os.environ.get("LAKE_RUN_TIMEOUT_S", 600))
# Timer wait: daemon CPU below this for at least IDLE_MIN_S while the uploader holds
# every bundle, has no upload pending and keeps open files.
IDLE_CORES = 0.1
IDLE_MIN_S = 0.5
BUSY_CORES = 0.15  # CPU used by other processes during a run that earns a warning
STARVED_S = 1.0  # daemon idle beyond the timer wait that earns a warning
SUBSCRIBER = "uploader"
LAKE_SETTINGS: dict[str, Any] = {
    "lake.compression_level": COMPRESSION_LEVEL,
    "lake.row_group_bytes": ROW_GROUP_BYTES,
    "lake.file_size_bytes": FILE_SIZE_BYTES,
    "lake.parallelism": PARALLELISM,
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    volume = VOLUME_BYTES // 8 if args.quick else VOLUME_BYTES
    sustained_s = SUSTAINED_S * 0.4 if args.quick else SUSTAINED_S
    pool = Pool.make(POOL, BUNDLE_BYTES, SEED)
    meta = {"commit": git_head(), "cores": os.cpu_count(), "python": platform.python_version(),
            "pyarrow": pa.__version__, "filesystem": filesystem_of(root), "quick": args.quick,
            "repeat": args.repeat, "shards": SHARDS, "volume_bytes": volume,
            "bundle_ipc_bytes": pool.mean_bytes, "file_duration_ms": args.file_duration_ms,
            "settings": LAKE_SETTINGS}
    print(f"# quiverd lake bench at commit {meta['commit'] or '?'}: {os.cpu_count()} cores, "
          f"data under {root} ({meta['filesystem']}), pyarrow {pa.__version__}, "
          f"{volume // MiB} MiB of ~1 MiB logs-like bundles per throughput run, "
          f"{args.repeat} pair(s) per client count", flush=True)
    lake = {**LAKE_SETTINGS, "lake.file_duration_ms": args.file_duration_ms}
    throughput = []
    if "throughput" in args.only:
        for clients in args.clients:
            throughput.append(run_throughput(pool, clients, volume, args.repeat, root, lake,
                                             args.profile, args.logs))
    sustained = None
    if "sustained" in args.only:
        rate = args.rate_mbps or (RATE_FRACTION * throughput[0]["uploader_mb_s"]
                                  if throughput else None)
        if rate is None:
            raise SystemExit("--only sustained needs --rate-mbps")
        sustained = run_sustained(pool, rate, sustained_s, root, lake, args.logs)
    print()
    print(report(meta, throughput, sustained))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"meta": meta, "throughput": throughput, "sustained": sustained}, indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="64 MiB per throughput run, 8 s of sustained ingest")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--repeat", type=int, default=2,
                   help="uploader/baseline pairs per client count (default 2)")
    p.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")],
                   default=list(CLIENTS), metavar="N,...",
                   help="client counts of the throughput part (default 1,4)")
    p.add_argument("--rate-mbps", type=float,
                   help="sustained phase rate, 10^6 B/s of Arrow IPC (default 60 %% of the "
                        "single-client uploader rate measured first)")
    p.add_argument("--only", type=lambda s: s.split(","), default=["throughput", "sustained"],
                   metavar="PART,...", help="throughput, sustained (default both)")
    p.add_argument("--file-duration-ms", type=int, default=FILE_DURATION_MS,
                   help=f"lake.file_duration_ms (default {FILE_DURATION_MS}: size decides)")
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where fresh data dirs are made (must be the real disk, not tmpfs)")
    p.add_argument("--logs", metavar="DIR",
                   help="keep each daemon's log (JSON lines, lake events at info) in DIR")
    p.add_argument("--profile", metavar="DIR",
                   help="`py-spy record` the daemon while it converts (collapsed stacks in "
                        "DIR/convert-<clients>c-<repeat>.txt; PY_SPY_FLAGS adds flags)")
    return p


# ---- payload ---------------------------------------------------------------------------
LEVELS = pa.array(["INFO", "DEBUG", "WARN", "ERROR", "FATAL"])
LEVEL_WEIGHTS = np.array([0.70, 0.15, 0.10, 0.04, 0.01])
SERVICES = pa.array([f"{team}-{role}" for team in ("checkout", "payments", "search",
                                                    "catalog", "auth", "cart", "orders",
                                                    "shipping")
                     for role in ("api", "worker", "gateway", "cron", "consumer")])
HOSTS = pa.array([f"ip-10-{i // 256}-{i % 256}-{i * 37 % 250}.eu-west-1.compute.internal"
                  for i in range(240)])
VERBS = pa.array(["GET", "GET", "GET", "POST", "PUT", "DELETE"])
RESOURCES = pa.array(["items", "users", "orders", "carts", "search", "health", "sessions"])
STATUSES = np.array([200, 200, 200, 200, 201, 204, 304, 400, 404, 500], np.int16)


@dataclass
class Pool:
    """``POOL`` distinct logs-like bundles as IPC streams; client i sends them cycled
    from offset 17 i, so clients do not send the same bundle at the same time."""

    ipc: list[bytes]
    rows: list[int]

    @classmethod
    def make(cls, count: int, target_bytes: int, seed: int) -> Pool:
        """Deterministic in ``seed``: producer processes rebuild the same pool."""
        rng = np.random.default_rng(seed)
        probe = len(encode_ipc_stream(_logs_batch(4096, 0, rng))) / 4096
        rows = int((target_bytes - 2048) / probe)  # ~2 KiB of schema and dictionaries
        batches = [_logs_batch(rows, k * rows, rng) for k in range(count)]
        return cls(ipc=[encode_ipc_stream(b) for b in batches], rows=[rows] * count)

    @property
    def mean_bytes(self) -> float:
        return statistics.mean(len(p) for p in self.ipc)

    def sequence(self, client: int, bundles: int) -> list[int]:
        """Pool indexes of the bundles client ``client`` sends, in order."""
        return [(client * 17 + k) % len(self.ipc) for k in range(bundles)]

    def table(self, index: int) -> pa.Table:
        return pa.ipc.open_stream(self.ipc[index]).read_all()


def _logs_batch(rows: int, first_row: int, rng: np.random.Generator) -> pa.RecordBatch:
    """ts, level and service (dictionaries), host, message, latency, user, status, trace:
    ~180 IPC bytes a row."""
    ts = 1_700_000_000_000_000 + (first_row + np.arange(rows)) * 150 + rng.integers(0, 150, rows)
    level = pa.DictionaryArray.from_arrays(
        pa.array(rng.choice(len(LEVELS), rows, p=LEVEL_WEIGHTS).astype(np.int32)), LEVELS)
    service = pa.DictionaryArray.from_arrays(
        pa.array(rng.integers(0, len(SERVICES), rows).astype(np.int32)), SERVICES)
    status = STATUSES[rng.integers(0, len(STATUSES), rows)]
    user = (rng.zipf(1.3, rows) % 2_000_000).astype(np.int64)

    def text(values: np.ndarray) -> pa.Array:
        return pc.cast(pa.array(values), pa.utf8())

    def pick(choices: pa.Array) -> pa.Array:
        return choices.take(pa.array(rng.integers(0, len(choices), rows)))

    message = pc.binary_join_element_wise(
        pick(VERBS), " /api/v", text(rng.integers(1, 4, rows)), "/", pick(RESOURCES), "/",
        text(rng.integers(0, 10**7, rows)), " status=", text(status), " bytes=",
        text(rng.integers(0, 65536, rows)), " user=", text(user), " ua=Mozilla/5.0", "")
    trace = pc.utf8_lpad(text(rng.integers(0, 2**62, rows)), 19, "0")
    return pa.record_batch(
        [pa.array(ts, pa.timestamp("us", tz="UTC")), level, service, pick(HOSTS), message,
         pa.array(np.round(rng.lognormal(3.0, 1.0, rows), 3)), pa.array(user),
         pa.array(status), trace],
        names=["ts", "level", "service", "host", "message", "latency_ms", "user_id",
               "status", "trace_id"])


# ---- a daemon over one data directory, restartable --------------------------------------
class LakeDaemon(Daemon):
    """``_common.Daemon`` on a directory it is given, so a second daemon can take over
    the first one's data directory; ``tag`` names its config and log files."""

    def __init__(self, directory: Path, *, tag: str, settings: dict[str, Any]) -> None:
        super().__init__(directory.parent, policy=None, shards=SHARDS, settings=settings,
                         directory=directory, tag=tag)

    def status(self) -> dict[str, Any]:
        """Admin ``status``; right after start the socket may be bound but not listening."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                status: dict[str, Any] = admin_request(self.admin_socket, "status")
                return status
            except QuiverError as exc:
                if time.monotonic() > deadline or not isinstance(exc.__cause__,
                                                                  ConnectionRefusedError):
                    raise
            time.sleep(0.01)

    def stop_ok(self) -> None:
        code = self.stop()
        if code != 0:
            raise RuntimeError(f"quiverd exited with {code}:\n{self.log_tail()}")


@dataclass
class Sample:
    """One poll of a daemon: wall time, CPU ticks of the process, the uploader's state."""

    t: float
    cpu_ticks: int
    rows: int
    files: int
    lag_bundles: int
    lag_bytes: int
    unacked: int
    pending_files: int
    open_files: int
    buffered_bytes: int

    @classmethod
    def take(cls, daemon: LakeDaemon) -> Sample:
        user, system = process_ticks(daemon.pid)
        st = daemon.status()
        lake = st["lake"]
        lag = st["metrics"]["quiver_subscriber_lag"].get(SUBSCRIBER, {})
        return cls(t=time.perf_counter(), cpu_ticks=user + system,
                   rows=lake.get("rows", 0), files=lake.get("files_uploaded", 0),
                   lag_bundles=lag.get("lag_bundles", -1), lag_bytes=lag.get("lag_bytes", -1),
                   unacked=lake.get("unacked_bundles", 0),
                   pending_files=lake.get("pending_files", 0),
                   open_files=lake.get("open_files", 0),
                   buffered_bytes=lake.get("buffered_bytes", 0))

    def done(self, rows: int) -> bool:
        return self.rows >= rows and self.lag_bundles == 0

    def unconverted_bytes(self, bundle_bytes: float) -> float:
        """IPC bytes not yet in Parquet: bundles the uploader has not taken (estimated
        at ``bundle_bytes`` each) plus what it buffers for the next row group. Bundles
        already encoded into a file that is still open or uploading are not counted."""
        return max(self.lag_bundles - self.unacked, 0) * bundle_bytes + self.buffered_bytes

    def waiting_for_timer(self) -> bool:
        """Every bundle delivered, nothing to upload, files open: only time rotates them."""
        return self.unacked == self.lag_bundles > 0 and self.pending_files == 0 \
            and self.open_files > 0


def process_ticks(pid: int) -> tuple[int, int]:
    """(user, system) clock ticks of a whole process, ended threads included: per-thread
    accounting (``thread_cpu_s``) loses the anyio workers that exit after 10 s idle."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def timer_wait_s(samples: list[Sample]) -> float:
    """Seconds in stretches of at least ``IDLE_MIN_S`` in which the daemon used under
    ``IDLE_CORES`` and the uploader only waited for ``file_duration_ms``."""
    return idle_s(samples, lambda s: s.waiting_for_timer())


def timer_wait_cpu_s(samples: list[Sample]) -> float:
    """The daemon's CPU seconds inside those stretches (status polls, timers): not
    conversion work, so left out of its busy CPU as the stretches are of its time."""
    return sum((b.cpu_ticks - a.cpu_ticks) / CLOCK_TICKS
               for a, b in _idle_stretches(samples, lambda s: s.waiting_for_timer()))


def idle_s(samples: list[Sample], also: Callable[[Sample], bool] = lambda s: True) -> float:
    """Seconds in stretches of at least ``IDLE_MIN_S`` in which the daemon used under
    ``IDLE_CORES`` (and ``also`` held at both ends of every poll interval)."""
    return sum(b.t - a.t for a, b in _idle_stretches(samples, also))


def _idle_stretches(samples: list[Sample], also: Callable[[Sample], bool]
                    ) -> list[tuple[Sample, Sample]]:
    out, start = [], None
    for a, b in zip(samples, samples[1:], strict=False):
        cores = (b.cpu_ticks - a.cpu_ticks) / CLOCK_TICKS / max(b.t - a.t, 1e-9)
        # One 10 ms tick in a 100 ms poll is already 0.1 cores: judge single polls
        # loosely and the whole stretch strictly.
        idle = cores < 2 * IDLE_CORES and also(a) and also(b)
        if idle and start is None:
            start = a
        elif not idle and start is not None:
            out.append((start, a))
            start = None
    if start is not None:
        out.append((start, samples[-1]))
    return [(a, b) for a, b in out if _idle_stretch(a, b)]


def _idle_stretch(first: Sample, last: Sample) -> bool:
    seconds = last.t - first.t
    cores = (last.cpu_ticks - first.cpu_ticks) / CLOCK_TICKS / max(seconds, 1e-9)
    return seconds >= IDLE_MIN_S and cores < IDLE_CORES


# ---- part 1: converting a backlog ------------------------------------------------------
def run_throughput(pool: Pool, clients: int, volume: int, repeat: int, root: Path,
                   lake: dict[str, Any], profile: str | None, logs: str | None
                   ) -> dict[str, Any]:
    """``repeat`` uploader/baseline pairs, alternating which goes first."""
    per_client = max(volume // BUNDLE_BYTES // clients, 1)
    plan = {c: pool.sequence(c, per_client) for c in range(clients)}
    pairs = []
    splits: dict[int, list[int]] | None = None
    for rep in range(repeat):
        base = None  # alternate which goes first: page-cache state drifts between runs
        if rep % 2 == 1 and splits is not None:
            base = run_baselines(pool, plan, splits, root)
        spy = Path(profile) / f"convert-{clients}c-{rep}.txt" if profile else None
        up = run_uploader(pool, plan, root, lake, spy, logs)
        splits = up.pop("splits")
        if base is None:
            base = run_baselines(pool, plan, splits, root)
        pairs.append((up, base))
        print(_line(clients, rep, up, base), flush=True)
    return summarize(clients, pool, plan, pairs)


def run_uploader(pool: Pool, plan: dict[int, list[int]], root: Path, lake: dict[str, Any],
                 spy_out: Path | None, logs: str | None) -> dict[str, Any]:
    """Ingest everything with the lake off, then time the lake converting it."""
    directory = Path(tempfile.mkdtemp(prefix="qd-lake-", dir=root))
    rows = sum(pool.rows[i] for seq in plan.values() for i in seq)
    ipc_bytes = sum(len(pool.ipc[i]) for seq in plan.values() for i in seq)
    try:
        off = LakeDaemon(directory, tag="ingest", settings={"lake.enabled": False})
        try:
            ingest_s = _produce(off, plan, rate_bundles_s=0.0)[0]
        finally:
            off.stop_ok()
        on = LakeDaemon(directory, tag="lake",
                        settings={**lake, "lake.enabled": True, "log.level": "info"})
        try:
            conv = _convert(on, rows, spy_out)
        finally:
            on.stop_ok()
        rotations = _rotations(on.log_path)
        files = _object_files(on.data_dir / "objects")
    finally:
        _remove(directory, logs)
    got = sum(f["rows"] for fs in files.values() for f in fs)
    if got != rows:
        raise AssertionError(f"objects hold {got} rows, {rows} sent")
    names = client_names(len(plan), SHARDS, "lake")
    splits = {c: _bundles_per_file([pool.rows[i] for i in plan[c]],
                                   [f["rows"] for f in files.get(names[c], [])])
              for c in plan}
    busy = conv["wall_s"] - conv["timer_wait_s"]
    return {**conv, "ingest_s": ingest_s, "ipc_bytes": ipc_bytes, "rows": rows,
            "busy_s": busy, "mb_s": ipc_bytes / busy / 1e6,
            "wall_mb_s": ipc_bytes / conv["wall_s"] / 1e6, "rotations": rotations,
            "files": sum(len(fs) for fs in files.values()),
            "parquet_bytes": sum(f["bytes"] for fs in files.values() for f in fs),
            "row_groups": sum(f["row_groups"] for fs in files.values() for f in fs),
            "row_group_mib": [g for fs in files.values() for f in fs for g in f["rg_mib"]],
            "splits": splits}


def _convert(daemon: LakeDaemon, rows: int, spy_out: Path | None) -> dict[str, Any]:
    """Poll from "ready" until every bundle is in a registered file."""
    cpu0, busy0, own0 = thread_cpu_s(daemon.pid), machine_busy_s(), _own_cpu_s()
    ticks0 = process_ticks(daemon.pid)
    foreign0 = foreign_cpu_s(os.getpid())
    spy = _start_py_spy(daemon.pid, spy_out) if spy_out is not None else None
    samples = [Sample.take(daemon)]
    while not samples[-1].done(rows):
        if samples[-1].t - daemon.ready > RUN_TIMEOUT_S:
            raise TimeoutError(f"the lake did not convert {rows} rows in {RUN_TIMEOUT_S} s: "
                               f"{samples[-1]}\n{daemon.log_tail()}")
        time.sleep(POLL_S)
        samples.append(Sample.take(daemon))
    end = samples[-1].t
    loop_s = cpu_delta(daemon.pid, cpu0, thread_cpu_s(daemon.pid)).main_s
    user, system = (b - a for a, b in zip(ticks0, process_ticks(daemon.pid), strict=True))
    daemon_s = (user + system) / CLOCK_TICKS
    busy, own = machine_busy_s() - busy0, _own_cpu_s() - own0
    foreign = foreign_delta_s(foreign0, foreign_cpu_s(os.getpid()))
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    wall = end - daemon.ready
    return {"wall_s": wall, "startup_s": daemon.ready - daemon.spawned,
            "rows_at_ready": samples[0].rows, "timer_wait_s": timer_wait_s(samples),
            "idle_s": idle_s(samples),
            "daemon_cpu_s": daemon_s,
            "daemon_busy_cpu_s": daemon_s - timer_wait_cpu_s(samples), "daemon_loop_cpu_s": loop_s,
            "daemon_sys_cpu_s": system / CLOCK_TICKS, "machine_cpu_cores": busy / wall,
            # Short-lived processes (another session's tests) exit before foreign_cpu_s
            # sees them: the machine's busy time minus ours counts them (and writeback).
            "other_cpu_cores": max(busy - daemon_s - own, 0.0) / wall,
            "foreign_cpu_cores": foreign / wall}


def _produce(daemon: LakeDaemon, plan: dict[int, list[int]], rate_bundles_s: float,
             progress: Any = None, on_start: Callable[[float], None] | None = None
             ) -> tuple[float, list[dict[str, Any]]]:
    """One producer process per client; returns (seconds from the barrier to the last
    ack, the producers' reports). ``on_start`` gets the time the barrier opened."""
    ctx = mp.get_context("spawn")  # no fork after pyarrow's threads exist
    barrier = ctx.Barrier(len(plan) + 1)
    results: Any = ctx.Queue()
    names = client_names(len(plan), SHARDS, "lake")
    procs = [ctx.Process(target=_producer, args=(
        str(daemon.socket), names[c], plan[c], rate_bundles_s / len(plan), barrier, results,
        progress)) for c in plan]
    try:
        for proc in procs:
            proc.start()
        try:
            barrier.wait(RUN_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"producer failed: {results.get(timeout=10).get('error')}"
                               ) from None
        t0 = time.perf_counter()
        if on_start is not None:
            on_start(t0)
        outs = [results.get(timeout=RUN_TIMEOUT_S) for _ in procs]
        failed = [o["error"] for o in outs if "error" in o]
        if failed:
            raise RuntimeError(f"producer failed: {failed[0]}\n{daemon.log_tail()}")
        for proc in procs:
            proc.join(RUN_TIMEOUT_S)
        return max(o["t1"] for o in outs) - t0, outs
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()


def _producer(socket_path: str, name: str, sequence: list[int], bundles_s: float,
              barrier: Any, results: Any, progress: Any) -> None:
    """One producer process: rebuild the pool, wait for the others, send ``sequence``
    pipelined (paced at ``bundles_s`` unless 0); ``progress`` counts IPC bytes sent."""
    try:
        pool = Pool.make(POOL, BUNDLE_BYTES, SEED)
        tables = {i: pool.table(i) for i in set(sequence)}
        with Client.connect(socket_path) as client:
            barrier.wait(RUN_TIMEOUT_S)
            t0 = time.perf_counter()
            items = _paced([tables[i] for i in sequence], bundles_s,
                           [len(pool.ipc[i]) for i in sequence], progress)
            for _ in client.iter_send(items, client=name):
                pass
            results.put({"t0": t0, "t1": time.perf_counter(), "bundles": len(sequence)})
    except BaseException as exc:  # reported to the parent, which fails the run
        barrier.abort()
        results.put({"error": repr(exc)})


def _paced(tables: list[pa.Table], bundles_s: float, sizes: list[int], progress: Any
           ) -> Iterator[pa.Table]:
    """The k-th table not before start + k / ``bundles_s`` (0 = as fast as acks allow).

    ``progress`` counts bytes as they are handed to the client: its acks reach the
    producer late at a slow pace (``iter_send`` fills its in-flight window first).
    """
    t0 = time.perf_counter()
    for k, table in enumerate(tables):
        delay = t0 + k / bundles_s - time.perf_counter() if bundles_s else 0.0
        if delay > 0:
            time.sleep(delay)
        if progress is not None:
            with progress.get_lock():
                progress.value += sizes[k]
        yield table


def _remove(directory: Path, logs: str | None) -> None:
    """Delete a run's directory, first copying its daemon logs to ``logs`` if given."""
    if logs is not None:
        Path(logs).mkdir(parents=True, exist_ok=True)
        for log in directory.glob("daemon-*.log"):
            shutil.copy(log, Path(logs) / f"{directory.name}-{log.name}")
    shutil.rmtree(directory, ignore_errors=True)


def _rotations(log_path: Path) -> dict[str, int]:
    """Files rotated, by reason, from the daemon's ``lake_file_rotated`` events."""
    out: dict[str, int] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if '"lake_file_rotated"' in line:
            reason = json.loads(line).get("reason", "?")
            out[reason] = out.get(reason, 0) + 1
    return out


def _object_files(objects: Path) -> dict[str, list[dict[str, Any]]]:
    """Per client, the uploaded files in creation order: rows, row groups, bytes."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(objects.rglob("*.parquet"), key=lambda p: p.name):
        meta = pq.read_metadata(path)
        client = meta.metadata[b"quiver.client"].decode()
        out.setdefault(client, []).append({
            "rows": meta.num_rows, "row_groups": meta.num_row_groups,
            "bytes": path.stat().st_size,
            "rg_mib": [round(meta.row_group(i).total_byte_size / MiB, 1)
                       for i in range(meta.num_row_groups)]})
    return out


def _bundles_per_file(bundle_rows: list[int], file_rows: list[int]) -> list[int]:
    """How many of a client's bundles (in order) each of its files holds: a bundle's
    rows are never split, so the cumulative row counts meet at bundle boundaries."""
    out, k = [], 0
    for rows in file_rows:
        start = k
        while rows > 0:
            rows -= bundle_rows[k]
            k += 1
        if rows != 0:
            raise AssertionError("a file's rows do not end at a bundle boundary")
        out.append(k - start)
    assert k == len(bundle_rows), (k, len(bundle_rows))
    return out


# ---- the baseline: plain pyarrow -------------------------------------------------------
def run_baselines(pool: Pool, plan: dict[int, list[int]], splits: dict[int, list[int]],
                  root: Path) -> dict[str, Any]:
    """Both layouts, the tables as sent first."""
    return {layout: run_baseline(pool, plan, splits, root, layout)
            for layout in ("as_sent", "uploader_columns")}


def run_baseline(pool: Pool, plan: dict[int, list[int]], splits: dict[int, list[int]],
                 root: Path, layout: str) -> dict[str, Any]:
    """Every client's bundles into the same number of files as the uploader made,
    ``PARALLELISM`` writer threads, one task per client; timed from the IPC bytes in
    memory to the directory's fsync."""
    out = Path(tempfile.mkdtemp(prefix="qd-lake-pyarrow-", dir=root))
    try:
        cpu0, t0 = os.times(), time.perf_counter()
        with ThreadPoolExecutor(PARALLELISM) as workers:
            futures = [workers.submit(_write_client, pool, out, c, plan[c], splits[c], layout)
                       for c in plan]
            written = [f.result() for f in futures]
        _fsync_dir(out)
        seconds, cpu1 = time.perf_counter() - t0, os.times()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    ipc_bytes = sum(len(pool.ipc[i]) for seq in plan.values() for i in seq)
    return {"seconds": seconds, "mb_s": ipc_bytes / seconds / 1e6,
            "cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
            "files": sum(len(s) for s in splits.values()), "parquet_bytes": sum(written)}


def _write_client(pool: Pool, out: Path, client: int, sequence: list[int], split: list[int],
                  layout: str) -> int:
    """One client's files, one after the other; returns the bytes written."""
    written, k = 0, 0
    group = ROW_GROUP_BYTES // BUNDLE_BYTES
    for n, count in enumerate(split):
        tables = [pool.table(i) for i in sequence[k:k + count]]
        if layout == "uploader_columns":
            tables = [_uploader_columns(t, client, k + j) for j, t in enumerate(tables)]
        k += count
        path = out / f"client{client}-{n}.parquet"
        with pq.ParquetWriter(path, tables[0].schema, compression="zstd",
                              compression_level=COMPRESSION_LEVEL, write_statistics=True,
                              write_page_index=True, write_page_checksum=True) as writer:
            for g in range(0, len(tables), group):
                writer.write_table(pa.concat_tables(tables[g:g + group]),
                                   row_group_size=ROW_GROUP_ROWS)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        written += path.stat().st_size
    return written


def _uploader_columns(table: pa.Table, client: int, bundle: int) -> pa.Table:
    """The layout the uploader writes: dictionaries as plain values, plus its columns
    _quiver_ingested_at, _quiver_shard, _quiver_segment, _quiver_bundle (constants)."""
    n = table.num_rows
    columns = [c.cast(c.type.value_type) if pa.types.is_dictionary(c.type) else c
               for c in table.columns]
    extras = {"_quiver_ingested_at": pa.array(np.full(n, time.time_ns()),
                                              pa.timestamp("ns", tz="UTC")),
              "_quiver_shard": pa.array(np.full(n, client % SHARDS, np.uint16)),
              "_quiver_segment": pa.array(np.full(n, bundle // 32, np.uint64)),
              "_quiver_bundle": pa.array(np.full(n, bundle % 32, np.uint32))}
    return pa.table([*columns, *extras.values()], names=[*table.column_names, *extras])


def _own_cpu_s() -> float:
    """CPU seconds of this process (all threads) and of its children that were waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = os.environ.get("PY_SPY_FLAGS", "").split()  # e.g. "--idle", "--gil"
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--rate", "250", "--threads",
         "--format", "raw", "--output", str(out), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# ---- part 2: keeping up with sustained ingest -------------------------------------------
def run_sustained(pool: Pool, rate_mb_s: float, seconds: float, root: Path,
                  lake: dict[str, Any], logs: str | None) -> dict[str, Any]:
    """One producer at ``rate_mb_s`` for ``seconds`` into a daemon with the lake on;
    a line per second; then until every bundle is in a registered file."""
    directory = Path(tempfile.mkdtemp(prefix="qd-lake-", dir=root))
    bundles = max(round(rate_mb_s * 1e6 / pool.mean_bytes * seconds), 1)
    plan = {0: pool.sequence(0, bundles)}
    rows = sum(pool.rows[i] for i in plan[0])
    print(f"\n# sustained: 1 producer at {rate_mb_s:.0f} MB/s for {seconds:.0f} s "
          f"({bundles} bundles), lake on. Per second: MB handed to the client; the "
          "uploader's lag (segment MB retained for it, bundles not acked); MB not yet in "
          "Parquet (not taken + buffered); files uploaded", flush=True)
    try:
        daemon = LakeDaemon(directory, tag="sustained",
                            settings={**lake, "lake.enabled": True, "log.level": "info"})
        try:
            polled = _poll_while_producing(daemon, plan, rows, pool.mean_bytes,
                                           rate_mb_s * 1e6 / pool.mean_bytes)
        finally:
            daemon.stop_ok()
        rotations = _rotations(daemon.log_path)
    finally:
        _remove(directory, logs)
    return {**polled, "rate_target_mb_s": rate_mb_s, "seconds_target": seconds,
            "bundles": bundles, "rows": rows, "rotations": rotations}


def _poll_while_producing(daemon: LakeDaemon, plan: dict[int, list[int]], rows: int,
                          bundle_bytes: float, bundles_s: float) -> dict[str, Any]:
    """Run the producer in a thread (it waits for its process), sample here."""
    progress = mp.get_context("spawn").Value("q", 0)
    started = threading.Event()
    outcome: dict[str, Any] = {}

    def on_start(t0: float) -> None:
        outcome["t0"] = t0
        started.set()

    def produce() -> None:
        try:
            outcome["ingest_s"] = _produce(daemon, plan, bundles_s, progress, on_start)[0]
        except BaseException as exc:  # re-raised by the polling thread
            outcome["error"] = exc
            started.set()

    producer = threading.Thread(target=produce, name="lake-bench-producer")
    producer.start()
    try:
        started.wait(RUN_TIMEOUT_S)
        if "error" in outcome:
            raise outcome["error"]
        t0: float = outcome["t0"]
        samples, series = _poll_loop(daemon, rows, t0, bundle_bytes, producer, progress,
                                     outcome)
    finally:
        producer.join(RUN_TIMEOUT_S)
    t_stop = t0 + outcome["ingest_s"]
    during = [s for s in samples if s.t <= t_stop]
    after = [s for s in samples if s.t >= t_stop]
    ticks = during[-1].cpu_ticks - during[0].cpu_ticks
    return {"ingest_s": outcome["ingest_s"], "sent_bytes": progress.value,
            "sent_mb_s": progress.value / outcome["ingest_s"] / 1e6, "series": series,
            "lag_mb": _peaks([(s.t - t0, s.lag_bytes) for s in during]),
            "unconverted_mb": _peaks([(s.t - t0, s.unconverted_bytes(bundle_bytes))
                                      for s in during]),
            "files_while_sending": during[-1].files, "files": samples[-1].files,
            "daemon_cpu_cores": ticks / CLOCK_TICKS / max(during[-1].t - during[0].t, 1e-9),
            "drain_s": samples[-1].t - t_stop, "drain_timer_wait_s": timer_wait_s(after)}


def _poll_loop(daemon: LakeDaemon, rows: int, t0: float, bundle_bytes: float,
               producer: threading.Thread, progress: Any, outcome: dict[str, Any]
               ) -> tuple[list[Sample], list[dict[str, float]]]:
    """Sample every ``POLL_S``, print a line a second, until the producer is done and
    every bundle is in a registered file."""
    samples: list[Sample] = []
    series: list[dict[str, float]] = []
    next_line = t0 + 1.0
    while True:
        s = Sample.take(daemon)
        samples.append(s)
        if s.t >= next_line:
            series.append(_second(s, t0, progress.value, bundle_bytes, samples,
                                  producer.is_alive()))
            next_line += 1.0
        if "error" in outcome:
            raise outcome["error"]
        if not producer.is_alive() and s.done(rows):
            return samples, series
        if s.t - t0 > RUN_TIMEOUT_S:
            raise TimeoutError(f"not converted within {RUN_TIMEOUT_S} s: {s}\n"
                               + daemon.log_tail())
        time.sleep(POLL_S)


def _second(s: Sample, t0: float, sent: int, bundle_bytes: float, samples: list[Sample],
            producing: bool) -> dict[str, float]:
    """One line of the per-second report, printed and returned."""
    back = samples[max(len(samples) - 1 - round(1 / POLL_S), 0)]
    cores = (s.cpu_ticks - back.cpu_ticks) / CLOCK_TICKS / max(s.t - back.t, 1e-9)
    row = {"t_s": round(s.t - t0, 2), "sent_mb": sent / 1e6, "lag_mb": s.lag_bytes / 1e6,
           "lag_bundles": s.lag_bundles,
           "unconverted_mb": s.unconverted_bytes(bundle_bytes) / 1e6,
           "files_uploaded": s.files, "rows_in_lake": s.rows, "daemon_cores": cores}
    print(f"  {row['t_s']:5.1f} s  sent {row['sent_mb']:6.0f} MB  lag {row['lag_mb']:5.0f} MB "
          f"({s.lag_bundles:4d} bundles)  not in Parquet {row['unconverted_mb']:4.0f} MB  "
          f"files {s.files:3d}  daemon {cores:.2f} cores"
          + ("" if producing else "  (producer done)"), flush=True)
    return row


def _peaks(series: list[tuple[float, float]]) -> dict[str, float]:
    """Peak per third of the sending phase, and the value at its end (MB)."""
    end = series[-1][0]
    thirds = [max((b for t, b in series if k * end / 3 <= t <= (k + 1) * end / 3), default=0)
              for k in range(3)]
    return {"max": max(b for _, b in series) / 1e6, "first_third": thirds[0] / 1e6,
            "middle_third": thirds[1] / 1e6, "last_third": thirds[2] / 1e6,
            "at_stop": series[-1][1] / 1e6}


def keeps_up(s: dict[str, Any]) -> bool:
    """The MB not yet in Parquet stay bounded: from the middle to the last third of the
    run their peak grows by less than 10 % of what was sent meanwhile (and less than half
    a row group, the granularity of a flush). The uploader lag is no test: it grows by
    design until the first file reaches lake.file_size_bytes, then saws."""
    return bool(growth_mb(s) <= max(0.1 * s["sent_mb_s"] * s["ingest_s"] / 3,
                                    ROW_GROUP_BYTES / 2e6))


def growth_mb(s: dict[str, Any]) -> float:
    conv = s["unconverted_mb"]
    return float(conv["last_third"] - conv["middle_third"])


# ---- report ----------------------------------------------------------------------------
def summarize(clients: int, pool: Pool, plan: dict[int, list[int]],
              pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Medians over the pairs; the ratio is the median of per-pair ratios."""
    ups = [u for u, _ in pairs]

    def med(key: str) -> float:
        return statistics.median(u[key] for u in ups)

    def base(layout: str, key: str) -> float:
        return statistics.median(b[layout][key] for _, b in pairs)

    return {
        "clients": clients, "ipc_bytes": ups[0]["ipc_bytes"], "rows": ups[0]["rows"],
        "bundles": sum(len(s) for s in plan.values()),
        "uploader_mb_s": med("mb_s"), "uploader_wall_mb_s": med("wall_mb_s"),
        "wall_s": med("wall_s"), "timer_wait_s": med("timer_wait_s"), "busy_s": med("busy_s"),
        "idle_s": med("idle_s"),
        "pyarrow_mb_s": base("as_sent", "mb_s"),
        "pyarrow_uploader_columns_mb_s": base("uploader_columns", "mb_s"),
        "ratio": statistics.median(u["mb_s"] / b["as_sent"]["mb_s"] for u, b in pairs),
        "ratio_wall": statistics.median(u["wall_mb_s"] / b["as_sent"]["mb_s"] for u, b in pairs),
        "ratio_uploader_columns": statistics.median(
            u["mb_s"] / b["uploader_columns"]["mb_s"] for u, b in pairs),
        "ratio_range": _range(u["mb_s"] / b["as_sent"]["mb_s"] for u, b in pairs),
        "daemon_cpu_s": med("daemon_cpu_s"), "daemon_loop_cpu_s": med("daemon_loop_cpu_s"),
        "daemon_busy_cpu_s": med("daemon_busy_cpu_s"),
        "pyarrow_cpu_s": base("as_sent", "cpu_s"),
        # CPU efficiency: pyarrow's CPU seconds / the daemon's outside the timer wait.
        "cpu_ratio": statistics.median(cpu_ratio(u, b) for u, b in pairs),
        "cpu_ratio_range": _range(cpu_ratio(u, b) for u, b in pairs),
        "files": ups[0]["files"], "rotations": ups[0]["rotations"],
        "parquet_bytes": ups[0]["parquet_bytes"],
        "pyarrow_parquet_bytes": pairs[0][1]["as_sent"]["parquet_bytes"],
        "foreign_cpu_cores": max(u["foreign_cpu_cores"] for u in ups),
        "other_cpu_cores": max(u["other_cpu_cores"] for u in ups),
        "uploader": ups, "pyarrow": [b for _, b in pairs],
    }


def cpu_ratio(up: dict[str, Any], base: dict[str, Any]) -> float:
    return float(base["as_sent"]["cpu_s"] / max(up["daemon_busy_cpu_s"], 1e-9))


def _range(values: Iterator[float] | Any) -> tuple[float, float]:
    v = list(values)
    return min(v), max(v)


def _line(clients: int, rep: int, up: dict[str, Any], base: dict[str, Any]) -> str:
    plain, cols = base["as_sent"], base["uploader_columns"]
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(up["rotations"].items()))
    return (f"{clients} client(s) #{rep}: uploader {up['mb_s']:4.0f} MB/s "
            f"({up['wall_s']:.2f} s - {up['timer_wait_s']:.2f} s timer wait; daemon idle "
            f"{up['idle_s']:.1f} s in all; "
            f"{up['wall_mb_s']:.0f} MB/s on wall time) | pyarrow {plain['mb_s']:4.0f} MB/s "
            f"({plain['seconds']:.2f} s), uploader's columns {cols['mb_s']:.0f} MB/s | "
            f"ratio {up['mb_s'] / plain['mb_s']:.2f}x | {up['files']} files ({reasons}), "
            f"{up['row_groups']} row groups, {up['parquet_bytes'] / MiB:.0f} MiB vs "
            f"{plain['parquet_bytes'] / MiB:.0f} MiB | cpu daemon {up['daemon_cpu_s']:.1f} s "
            f"(loop {up['daemon_loop_cpu_s']:.1f}; busy {up['daemon_busy_cpu_s']:.1f}), "
            f"pyarrow {plain['cpu_s']:.1f} s, cpu ratio {cpu_ratio(up, base):.2f}x, "
            f"machine {up['machine_cpu_cores']:.2f} cores | ingest {up['ingest_s']:.1f} s, "
            f"startup {up['startup_s']:.2f} s"
            + (f" | OTHERS {up['other_cpu_cores']:.2f} cores"
               if up["other_cpu_cores"] > BUSY_CORES else "")
            + (f" | STARVED: daemon idle {starved:.1f} s while bundles were still undelivered"
               if (starved := up["idle_s"] - up["timer_wait_s"]) > STARVED_S else ""))


def report(meta: dict[str, Any], runs: list[dict[str, Any]], s: dict[str, Any] | None) -> str:
    """The closing tables (Markdown, for bench/README.md) and the sustained verdict."""
    out = [f"commit {meta['commit'] or '?'}, {meta['cores']} cores, {meta['filesystem']}, "
           f"Python {meta['python']}, pyarrow {meta['pyarrow']}, "
           f"lake.file_duration_ms {meta['file_duration_ms']}"
           + (", --quick" if meta["quick"] else "")]
    if runs:
        out += ["", "| clients | Arrow IPC MiB | files (rotated by) | uploader s: wall - timer "
                "wait = busy | daemon idle s | uploader MB/s | pyarrow MB/s | uploader / "
                "pyarrow (target ≥ 0.8×) | pyarrow, uploader's columns MB/s | daemon CPU s "
                "(loop; busy) | pyarrow CPU s | pyarrow CPU / daemon busy CPU (target ≥ 0.8×) |",
                "|" + "---:|" * 12]
        for r in runs:
            why = ", ".join(f"{n} {reason}" for reason, n in sorted(r["rotations"].items()))
            out.append(
                f"| {r['clients']} | {r['ipc_bytes'] / MiB:.0f} | {r['files']} ({why}) "
                f"| {r['wall_s']:.2f} - {r['timer_wait_s']:.2f} = {r['busy_s']:.2f} "
                f"| {r['idle_s']:.1f} | {r['uploader_mb_s']:.0f} | {r['pyarrow_mb_s']:.0f} "
                f"| {r['ratio']:.2f}× ({_span(r['ratio_range'])}) "
                f"| {r['pyarrow_uploader_columns_mb_s']:.0f} "
                f"| {r['daemon_cpu_s']:.1f} ({r['daemon_loop_cpu_s']:.1f}; "
                f"{r['daemon_busy_cpu_s']:.1f}) "
                f"| {r['pyarrow_cpu_s']:.1f} "
                f"| {r['cpu_ratio']:.2f}× ({_span(r['cpu_ratio_range'])}) |")
    if s is not None:
        conv, lag = s["unconverted_mb"], s["lag_mb"]
        out += ["", "| sustained | sent MB/s | MB not in Parquet: peak per third | uploader "
                "lag MB: peak per third | lag MB at stop | files uploaded while sending / in "
                "all | drain s (timer wait) | daemon CPU cores | keeps up? |",
                "|---|" + "---:|" * 7 + "---|",
                f"| 1 producer, {s['seconds_target']:.0f} s | {s['sent_mb_s']:.0f} "
                f"| {_thirds(conv)} | {_thirds(lag)} | {lag['at_stop']:.0f} "
                f"| {s['files_while_sending']} / {s['files']} "
                f"| {s['drain_s']:.1f} ({s['drain_timer_wait_s']:.1f}) "
                f"| {s['daemon_cpu_cores']:.2f} | {'yes' if keeps_up(s) else 'NO'} |",
                "", verdict(s)]
    return "\n".join(out)


def _span(r: tuple[float, float]) -> str:
    return f"{r[0]:.2f}–{r[1]:.2f}"


def _thirds(peaks: dict[str, float]) -> str:
    return f"{peaks['first_third']:.0f} / {peaks['middle_third']:.0f} / {peaks['last_third']:.0f}"


def verdict(s: dict[str, Any]) -> str:
    conv, lag = s["unconverted_mb"], s["lag_mb"]
    busy_drain = s["drain_s"] - s["drain_timer_wait_s"]
    drain = (f"the lag drains {s['drain_s']:.1f} s after the producer stops, "
             f"{s['drain_timer_wait_s']:.1f} s of it waiting for lake.file_duration_ms to "
             f"rotate the last, partly filled file ({busy_drain:.1f} s of work)")
    if keeps_up(s):
        files = ("falls as each file is registered" if s["files_while_sending"] else
                 "had no file filled yet: the run was shorter than one file takes to fill")
        return (f"KEEPS UP at {s['sent_mb_s']:.0f} MB/s: what is not yet in Parquet stays "
                f"bounded (peaks {_thirds(conv)} MB per third of the run); the uploader lag "
                f"(peaks {_thirds(lag)} MB) is the open file waiting to reach "
                f"lake.file_size_bytes, and {files}; {drain}.")
    return (f"Does NOT keep up at {s['sent_mb_s']:.0f} MB/s: what is not yet in Parquet "
            f"grows (peaks {_thirds(conv)} MB per third of the run, +{growth_mb(s):.0f} MB "
            f"in the last third; uploader lag peaks {_thirds(lag)} MB); {drain}.")


if __name__ == "__main__":
    sys.exit(main())
