"""Ingest throughput and ack latency of ``quiverd serve`` against a raw-WAL baseline
and a minimal durable Python server (the reference).

    python bench/ingest.py [--quick] [--json out.json] [--repeat N] [--profile DIR]
                           [--sides daemon,reference,baseline]

Per scenario (producers x bundle size x flush policy), ``--repeat`` rounds of runs,
one per side, back to back, alternating the order:

    daemon     N producer processes, each its own ``Client`` and client name (so they
               spread over the 2 shards), pipelining bundles (up to max_inflight) to a
               fresh ``quiverd serve``; throughput = acked payload bytes / wall time,
               latency = per-bundle submit -> ack receipt.
    baseline   N threads in this process appending the *same* WAL frames
               (``walformat.encode_entry``, precomputed) to one fresh file per shard
               used, with the daemon's fsync cadence: ``interval`` = fdatasync once
               1 MiB is unsynced or 25 ms passed, ``always`` = fdatasync per frame.
    reference  ``bench/reference.py`` (not product code: uvloop, recv_into, CRC-32C and
               full Arrow validation per frame, a writer and a syncer thread per
               shard), driven by N producer processes with the same payload bytes
               and the same window; the "Python floor" (issue 18).

All skip a warm-up (1/16 of the volume) before the clock starts. Throughputs are
medians over the repeats, ratios the median (and min-max) of per-repeat ratios, latency
percentiles pooled over every bundle of every repeat. See bench/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    BaselineWal,
    Daemon,
    KiB,
    MiB,
    client_names,
    cpu_delta,
    filesystem_of,
    foreign_cpu_s,
    foreign_delta_s,
    git_head,
    machine_busy_s,
    make_table,
    percentile,
    process_cpu_s,
    thread_cpu_s,
)
from _reference_side import run_reference  # noqa: E402

from quiverd.client.producer import Client  # noqa: E402
from quiverd.kernel.bundle import MetaCodec, make_slot  # noqa: E402
from quiverd.kernel.config import IngestConfig  # noqa: E402
from quiverd.net.admin import request as admin_request  # noqa: E402
from quiverd.wal import format as walformat  # noqa: E402

SHARDS = 2
FLUSH_INTERVAL_S = 0.025  # the daemon's default wal.flush_interval_ms
FLUSH_BYTES = 1 * MiB  # the daemon's default wal.flush_bytes
# The ingest core alone (issue 2): segments are not finalized during the run, so the
# daemon writes each byte once, like the baseline. bench/segments.py measures the
# same ingest with segments on against this figure.
SEGMENTS_OFF = {"segment.target_size_bytes": 1 << 40, "segment.max_open_duration_ms": 3_600_000,
                "wal.max_size_bytes": 64 << 30, "wal.max_chunks": 64}
# Payload bytes sent per run (split evenly over producers); --quick divides by 8.
VOLUME = {64 * KiB: 128 * MiB, 1 * MiB: 512 * MiB}
WARMUP_FRACTION = 16  # warm-up = volume / 16, not timed
RUN_TIMEOUT_S = 300.0
# Issue 18's targets (interval scenarios): 1 MiB >= 0.8x the raw baseline's MB/s;
# 64 KiB >= 0.8x the reference's bundles/s at <= 120 us of daemon CPU per bundle.
TARGET_RATIO = 0.8
TARGET_FLOOR_RATIO = 0.8
TARGET_CPU_US_PER_BUNDLE = 120.0
SIDES = ("baseline", "reference", "daemon")  # run in this order, reversed every other round


@dataclass
class Scenario:
    producers: int
    bundle_bytes: int
    policy: str
    bundles_per_producer: int
    warmup_per_producer: int
    pace_s: float = 0.0  # > 0: each producer submits one bundle per pace_s (paced run)

    @property
    def size_name(self) -> str:
        if self.bundle_bytes >= MiB:
            return f"{self.bundle_bytes // MiB}MiB"
        return f"{self.bundle_bytes // KiB}KiB"

    @property
    def name(self) -> str:
        return f"p{self.producers}-{self.size_name}-{self.policy}"


@dataclass
class Timed:
    """One side of one repeat, timed phase only."""

    seconds: float
    bundles: int
    payload_bytes: int
    latencies_s: list[float]  # per bundle: daemon submit -> ack, baseline write -> fdatasync
    cpu_s: float = math.nan  # the server's user + system CPU (daemon, reference)

    @property
    def mb_s(self) -> float:
        return self.payload_bytes / self.seconds / 1e6

    @property
    def bundles_s(self) -> float:
        return self.bundles / self.seconds


@dataclass
class Round:
    """One repeat: each side that ran (``--sides``), back to back."""

    daemon: Timed | None = None
    extra: dict[str, Any] | None = None  # the daemon's CPU, fsync and RSS figures
    reference: Timed | None = None
    baseline: Timed | None = None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    scenarios = [
        _scenario(p, size, policy, 8 if args.quick else 1)
        for size in (1 * MiB, 64 * KiB) for policy in ("interval", "always")
        for p in args.producers
    ]
    if args.only:
        scenarios = [s for s in scenarios if s.name in args.only]
    payloads = {size: make_table(size) for size in {s.bundle_bytes for s in scenarios}}
    print(f"# quiverd ingest bench: {len(scenarios)} scenarios x {args.repeat} rounds of "
          f"{','.join(args.sides)}, window {_window(args)}, {os.cpu_count()} cores, "
          f"data under {root} ({filesystem_of(root)}), pyarrow {pa.__version__}", flush=True)
    for size, (table, ipc) in sorted(payloads.items()):
        print(f"#   {size // KiB} KiB bundle: {table.num_rows} rows (int64 + utf8), "
              f"{len(ipc)} IPC bytes", flush=True)
    results: list[dict[str, Any]] = []
    for scn in scenarios:
        table, ipc = payloads[scn.bundle_bytes]
        rounds = [run_round(scn, table, ipc, root, args, rep) for rep in range(args.repeat)]
        row = summarize(scn, len(ipc), rounds)
        if scn.policy == "interval" and "daemon" in row:
            row["paced"] = paced_run(scn, ipc, root, args, row["daemon"]["bundles_s"])
        results.append(row)
        print(_line(row), flush=True)
    print()
    print(markdown(results))
    for line in target_lines(results):
        print(line)
    if args.json:
        meta = {"cores": os.cpu_count(), "python": platform.python_version(),
                "pyarrow": pa.__version__, "filesystem": filesystem_of(root),
                "commit": git_head(), "quick": args.quick, "repeat": args.repeat,
                "shards": SHARDS, "settings": _settings(args.set), "sides": args.sides,
                "window": _window(args)}
        Path(args.json).write_text(json.dumps({"meta": meta, "runs": results}, indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1/8 of the volume per run")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--repeat", type=int, default=3,
                   help="rounds (one run per side) per scenario (default 3)")
    p.add_argument("--sides", type=_sides, default=list(SIDES), metavar="SIDE,...",
                   help="run only these of daemon,reference,baseline (default all three)")
    p.add_argument("--producers", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 4], help="comma-separated producer counts (default 1,4)")
    p.add_argument("--only", type=lambda s: s.split(","), metavar="RUN,...",
                   help="run only these scenarios, by name (e.g. p1-1MiB-interval)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra daemon config key (e.g. wal.flush_bytes=1); repeatable. "
                        "The baseline keeps the default cadence")
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where fresh data dirs are made (must be the real disk, not tmpfs)")
    p.add_argument("--profile", metavar="DIR",
                   help="attach `py-spy record` to the daemon during each timed phase "
                        "(collapsed stacks in DIR/<run>-<repeat>.txt)")
    return p


def _sides(text: str) -> list[str]:
    sides = [s.strip() for s in text.split(",") if s.strip()]
    unknown = set(sides) - set(SIDES)
    if unknown or not sides:
        raise argparse.ArgumentTypeError(f"sides are {','.join(SIDES)}, not {text!r}")
    return sides


def _window(args: argparse.Namespace) -> int:
    """Bundles in flight per producer: what the daemon grants its clients."""
    return int(_settings(args.set).get("ingest.max_inflight_per_connection",
                                       IngestConfig().max_inflight_per_connection))


def run_round(scn: Scenario, table: pa.Table, ipc: bytes, root: Path,
              args: argparse.Namespace, rep: int) -> Round:
    """One run of each side back to back; the order flips every other round because
    the page-cache state drifts between runs."""
    order = [side for side in SIDES if side in args.sides]
    if rep % 2:
        order.reverse()
    out = Round()
    for side in order:
        if side == "baseline":
            out.baseline = run_baseline(scn, table, root)
        elif side == "reference":
            ref = run_reference(producers=scn.producers, ipc=ipc,
                                warmup=scn.warmup_per_producer,
                                bundles=scn.bundles_per_producer, window=_window(args),
                                shards=SHARDS, root=root, timeout_s=RUN_TIMEOUT_S)
            out.reference = Timed(seconds=ref.seconds, bundles=ref.bundles,
                                  payload_bytes=ref.bundles * len(ipc),
                                  latencies_s=ref.latencies_s, cpu_s=ref.server_cpu_s)
        else:
            out.daemon, out.extra = run_daemon(scn, ipc, root, args, rep)
    return out


def _scenario(producers: int, size: int, policy: str, divisor: int) -> Scenario:
    total = VOLUME[size] // divisor // size
    return Scenario(producers=producers, bundle_bytes=size, policy=policy,
                    bundles_per_producer=max(total // producers, 1),
                    warmup_per_producer=max(total // WARMUP_FRACTION // producers, 2))


PACED_SECONDS = 4.0  # length of the half-load run
ACK_P99_SLACK_MS = 5.0  # target: ack p99 <= flush interval + this, at half the peak load


def paced_run(scn: Scenario, ipc: bytes, root: Path, args: argparse.Namespace,
              peak_bundles_s: float) -> dict[str, Any]:
    """One more daemon run at half the peak rate just measured: ack latency under load
    the daemon can carry (full speed measures queueing behind 16 in flight)."""
    per_producer = peak_bundles_s / 2 / scn.producers
    paced = dataclasses.replace(scn, pace_s=1 / per_producer,
                                bundles_per_producer=max(int(per_producer * PACED_SECONDS), 8),
                                warmup_per_producer=4)
    timed, _ = run_daemon(paced, ipc, root, args, -1)
    lats = sorted(timed.latencies_s)
    return {"bundles_s": timed.bundles / timed.seconds, "mb_s": timed.mb_s,
            "lat_p50_ms": percentile(lats, 50) * 1e3, "lat_p99_ms": percentile(lats, 99) * 1e3,
            "target_p99_ms": FLUSH_INTERVAL_S * 1e3 + ACK_P99_SLACK_MS}


# ---- daemon side ---------------------------------------------------------------------
def run_daemon(scn: Scenario, ipc: bytes, root: Path, args: argparse.Namespace, rep: int
               ) -> tuple[Timed, dict[str, Any]]:
    """Start quiverd, drive it from ``scn.producers`` processes, stop it with SIGTERM."""
    daemon = Daemon(root, policy=scn.policy, shards=SHARDS,
                    settings={**SEGMENTS_OFF, **_settings(args.set)})
    ctx = mp.get_context("spawn")  # no fork after pyarrow's threads exist
    barrier = ctx.Barrier(scn.producers + 1)
    results: Any = ctx.Queue()
    procs = [ctx.Process(target=_producer, args=(str(daemon.socket), name, ipc, scn, barrier,
                                                 results))
             for name in client_names(scn.producers, SHARDS, scn.name)]
    spy: subprocess.Popen[bytes] | None = None
    try:
        for proc in procs:
            proc.start()
        try:
            barrier.wait(RUN_TIMEOUT_S)  # every producer connected and warmed up
        except threading.BrokenBarrierError:
            first = results.get(timeout=10)
            raise RuntimeError(f"{scn.name}: a producer failed before the timed phase: "
                               f"{first.get('error')}\n{daemon.log_tail()}") from None
        cpu_before, busy_before = thread_cpu_s(daemon.pid), machine_busy_s()
        process_before = process_cpu_s(daemon.pid)
        foreign_before = foreign_cpu_s(os.getpid())
        status_before = admin_request(daemon.admin_socket, "status")
        if args.profile:
            spy = _start_py_spy(daemon.pid, Path(args.profile) / f"{scn.name}-{rep}.txt")
        outs = [results.get(timeout=RUN_TIMEOUT_S) for _ in procs]
        cpu = cpu_delta(daemon.pid, cpu_before, thread_cpu_s(daemon.pid))
        process_cpu = process_cpu_s(daemon.pid) - process_before
        machine_busy = machine_busy_s() - busy_before
        foreign = foreign_delta_s(foreign_before, foreign_cpu_s(os.getpid()))
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        status_after = admin_request(daemon.admin_socket, "status")
        peak_rss_mib = _peak_rss_mib(daemon.pid)
        for proc in procs:
            proc.join(RUN_TIMEOUT_S)
        failed = [o["error"] for o in outs if "error" in o]
        if failed:
            raise RuntimeError(f"{scn.name}: producer failed: {failed[0]}\n{daemon.log_tail()}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        exit_code = daemon.stop()
        log = daemon.log_tail(5)
        daemon.remove()
    if exit_code != 0:
        raise RuntimeError(f"{scn.name}: quiverd exited with {exit_code}:\n{log}")
    start, end = min(o["t0"] for o in outs), max(o["t1"] for o in outs)
    bundles = sum(o["bundles"] for o in outs)
    timed = Timed(seconds=end - start, bundles=bundles, payload_bytes=bundles * len(ipc),
                  latencies_s=list(itertools.chain.from_iterable(o["lat"] for o in outs)),
                  cpu_s=process_cpu)
    fsyncs = _delta(status_before, status_after, "fsyncs")
    appends = _delta(status_before, status_after, "appends")
    extra = {
        "timed_window": [start, end],  # perf_counter (CLOCK_MONOTONIC) stamps
        "daemon_cpu_cores": cpu.total_s / timed.seconds,
        "daemon_loop_cpu_cores": cpu.main_s / timed.seconds,
        "daemon_worker_cpu_cores": cpu.workers_s / timed.seconds,
        "daemon_sys_cpu_cores": cpu.sys_s / timed.seconds,
        "producer_cpu_cores": sum(o["cpu_s"] for o in outs) / timed.seconds,
        # Everything, kernel writeback threads included; 2.0 = both cores saturated.
        "machine_cpu_cores": machine_busy / timed.seconds,
        # Other user-space processes (not this bench's): non-zero = a noisy neighbour.
        "foreign_cpu_cores": foreign / timed.seconds,
        "daemon_fsyncs": fsyncs,
        "daemon_peak_rss_mib": peak_rss_mib,
        "entries_per_fsync": appends / fsyncs if fsyncs else math.nan,
    }
    return timed, extra


def _peak_rss_mib(pid: int) -> float:
    """The daemon's peak resident set (VmHWM) so far, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


def rss_bound_mib(producers: int) -> float:
    """README's memory bound at this bench's settings: 150 MiB + 3 x the default segment
    target (32 MiB) + 64 MiB per shard + ingest.max_pending_bytes + 0.5 MiB per
    connection. (Segments are not finalized here, and the open segment holds no payload.)"""
    cfg = IngestConfig()
    return 150 + 3 * 32 + 64 * SHARDS + cfg.max_pending_bytes / MiB + 0.5 * producers


def _settings(pairs: list[str]) -> dict[str, Any]:
    """``["wal.flush_bytes=1", 'log.level="info"']`` -> typed values (TOML/JSON literals)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw  # a bare word is a string
    return out


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> int:
    return sum(a[key] - b[key] for a, b in zip(after["shards"], before["shards"], strict=True))


def _start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    out.parent.mkdir(parents=True, exist_ok=True)
    # PY_SPY_FLAGS adds options: "--idle" shows where threads wait, "--gil" who holds it.
    extra = os.environ.get("PY_SPY_FLAGS", "").split()
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--rate", "250", "--threads",
         "--format", "raw", "--output", str(out), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class _TimedClient(Client):
    """``Client`` that stamps each bundle: submit start -> the recv that brought its ack.

    Overrides two private hooks of ``Client``; a bench may lean on internals that a
    public API should not expose (iter_send yields acks only after refilling the
    window, which would add the next sends to every latency).
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.started: dict[int, float] = {}  # bounded by max_inflight
        self.latencies: list[float] = []

    def _submit(self, item: Any, client: str) -> int:
        t0 = time.perf_counter()
        request_id = super()._submit(item, client)
        self.started[request_id] = t0
        return request_id

    def _receive(self) -> None:
        super()._receive()
        now = time.perf_counter()
        for request_id in [r for r in self.started if self._requests.is_done(r)]:
            self.latencies.append(now - self.started.pop(request_id))


def _producer(socket_path: str, name: str, ipc: bytes, scn: Scenario, barrier: Any,
              results: Any) -> None:
    """One producer process: warm up, wait for the others, send the timed volume."""
    try:
        table = pa.ipc.open_stream(ipc).read_all()
        # Client.connect is typed as returning Client; it builds ``cls`` all the same.
        with cast(_TimedClient, _TimedClient.connect(socket_path)) as client:
            for _ in client.iter_send(itertools.repeat(table, scn.warmup_per_producer),
                                      client=name):
                pass
            client.latencies.clear()
            barrier.wait(RUN_TIMEOUT_S)
            cpu0, t0 = _own_cpu_s(), time.perf_counter()
            if scn.pace_s > 0:
                bundles = _paced(client, table, name, scn.bundles_per_producer, scn.pace_s)
            else:
                bundles = sum(1 for _ in client.iter_send(
                    itertools.repeat(table, scn.bundles_per_producer), client=name))
            t1 = time.perf_counter()
            results.put({"t0": t0, "t1": t1, "bundles": bundles, "lat": client.latencies,
                         "cpu_s": _own_cpu_s() - cpu0})
    except BaseException as exc:  # reported to the parent, which fails the run
        barrier.abort()
        results.put({"error": repr(exc), "t0": 0.0, "t1": 0.0, "bundles": 0, "lat": [],
                     "cpu_s": 0.0})


def _paced(client: _TimedClient, table: pa.Table, name: str, count: int,
           pace_s: float) -> int:
    """``count`` bundles, the k-th sent at start + k * pace_s, each waited for (so its
    latency is the daemon's, not time spent pacing the next one)."""
    start = time.perf_counter()
    for k in range(count):
        delay = start + k * pace_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        client.send(table, client=name)  # the client's hooks time submit -> ack
    return count


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# ---- baseline side -------------------------------------------------------------------
def run_baseline(scn: Scenario, table: pa.Table, root: Path) -> Timed:
    """The same frames, the same cadence, no daemon: a raw Python append loop.

    Thread i plays producer i and appends to the file of producer i's shard, so the
    baseline has as many files (and fdatasync streams) as the daemon has busy shards.
    """
    slot = make_slot(0, table)
    names = client_names(scn.producers, SHARDS, scn.name)
    meta = MetaCodec()
    workdir = Path(tempfile.mkdtemp(prefix="qb-", dir=root))
    files = [BaselineWal(workdir / f"baseline-{i}.log", policy=scn.policy,
                         flush_interval_s=FLUSH_INTERVAL_S, flush_bytes=FLUSH_BYTES)
             for i in range(min(scn.producers, SHARDS))]
    per = scn.warmup_per_producer + scn.bundles_per_producer
    frames: list[list[tuple[list[Any], int]]] = []
    for i, name in enumerate(names):
        slots = (slot, meta.encode(name, None))  # the daemon adds the same metadata slot
        size = walformat.entry_size(slots)
        frames.append([(walformat.encode_entry(ts_ns=time.time_ns(), sequence=i * per + k + 1,
                                               slots=slots), size) for k in range(per)])
    barrier = threading.Barrier(scn.producers + 1)
    lats: list[list[float]] = [[] for _ in names]

    def writer(i: int) -> None:
        wal, warm = files[i % len(files)], scn.warmup_per_producer
        for pieces, size in frames[i][:warm]:
            wal.append(pieces, size, [])
        barrier.wait()
        for pieces, size in frames[i][warm:]:
            wal.append(pieces, size, lats[i])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(scn.producers)]
    tail: list[float] = []
    try:
        for t in threads:
            t.start()
        barrier.wait(RUN_TIMEOUT_S)
        start = time.perf_counter()
        for t in threads:
            t.join()
        for wal in files:
            wal.close(tail)
        end = time.perf_counter()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    bundles = scn.producers * scn.bundles_per_producer
    return Timed(seconds=end - start, bundles=bundles, payload_bytes=bundles * len(slot.ipc),
                 latencies_s=list(itertools.chain(tail, *lats)))


# ---- report --------------------------------------------------------------------------
def summarize(scn: Scenario, ipc_len: int, rounds: list[Round]) -> dict[str, Any]:
    """Medians over repeats; ratios per round (its sides ran back to back, under the same
    page-cache conditions), then median and min-max; latency percentiles pooled."""
    row: dict[str, Any] = {
        "run": scn.name, "producers": scn.producers, "bundle": scn.size_name,
        "policy": scn.policy, "ipc_bytes": ipc_len, "repeats": len(rounds),
    }
    for side in SIDES:
        runs = [getattr(r, side) for r in rounds]
        if runs[0] is not None:
            row[side] = _side(runs)
    if "daemon" in row and "baseline" in row:
        _ratio(row, "ratio", [r.daemon.mb_s / r.baseline.mb_s for r in rounds
                              if r.daemon and r.baseline])
    if "daemon" in row and "reference" in row:
        _ratio(row, "floor_ratio", [r.daemon.bundles_s / r.reference.bundles_s
                                    for r in rounds if r.daemon and r.reference])
    extras = [r.extra for r in rounds if r.extra is not None]
    for key in extras[0] if extras else ():
        values = [e[key] for e in extras]
        row[key] = values if key == "timed_window" else statistics.median(values)
    return row


def _ratio(row: dict[str, Any], key: str, each: list[float]) -> None:
    row[key] = statistics.median(each)
    row[f"{key}_each"] = [round(x, 3) for x in each]
    row[f"{key}_range"] = [min(each), max(each)]


def _side(runs: list[Timed]) -> dict[str, Any]:
    lats = sorted(itertools.chain.from_iterable(r.latencies_s for r in runs))
    cpu_us = [r.cpu_s / r.bundles * 1e6 for r in runs]
    return {
        "mb_s": statistics.median(r.mb_s for r in runs),
        "mb_s_each": [round(r.mb_s, 1) for r in runs],
        "bundles_s": statistics.median(r.bundles_s for r in runs),
        "bundles_s_each": [round(r.bundles_s) for r in runs],
        "bundles": runs[0].bundles,
        "lat_p50_ms": percentile(lats, 50) * 1e3,
        "lat_p99_ms": percentile(lats, 99) * 1e3,
        "lat_max_ms": lats[-1] * 1e3,
        # Server CPU (user + system, every thread) / bundles acked; NaN for the baseline.
        "cpu_us_per_bundle": statistics.median(cpu_us),
        "cpu_us_per_bundle_each": [round(x, 1) for x in cpu_us],
    }


def _ratio_text(r: dict[str, Any], key: str) -> str:
    if key not in r:
        return "-"
    low, high = r[f"{key}_range"]
    return f"{r[key]:.2f}x ({low:.2f}-{high:.2f})"


def _line(r: dict[str, Any]) -> str:
    parts = [f"{r['run']:>18}:"]
    for side in ("daemon", "reference", "baseline"):
        if side not in r:
            continue
        s = r[side]
        each = "/".join(f"{x:.0f}" for x in s["mb_s_each"])
        text = (f"{side} {s['mb_s']:6.0f} MB/s ({each}) {s['bundles_s']:5.0f} b/s "
                f"ack p50 {s['lat_p50_ms']:6.1f} p99 {s['lat_p99_ms']:6.1f} ms")
        if not math.isnan(s["cpu_us_per_bundle"]):
            text += f" cpu {s['cpu_us_per_bundle']:.0f} us/bundle"
        parts.append(text + " |")
    parts.append(f"vs baseline {_ratio_text(r, 'ratio')} | vs reference "
                 f"{_ratio_text(r, 'floor_ratio')}")
    if "daemon" in r:
        parts.append(
            f"| cpu daemon {r['daemon_cpu_cores']:.2f} (loop {r['daemon_loop_cpu_cores']:.2f}, "
            f"sys {r['daemon_sys_cpu_cores']:.2f}) producers {r['producer_cpu_cores']:.2f} "
            f"machine {r['machine_cpu_cores']:.2f} foreign {r['foreign_cpu_cores']:.2f} | "
            f"{r['entries_per_fsync']:.1f} entries/fsync | peak RSS "
            f"{r['daemon_peak_rss_mib']:.0f} MiB (bound {rss_bound_mib(r['producers']):.0f})"
            + _paced_text(r))
    return " ".join(parts)


def _paced_text(r: dict[str, Any]) -> str:
    p = r.get("paced")
    if not p:
        return ""
    return (f" | half load {p['bundles_s']:.0f} b/s: ack p50 {p['lat_p50_ms']:.1f} p99 "
            f"{p['lat_p99_ms']:.1f} ms (target <= {p['target_p99_ms']:.0f})")


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| producers | bundle | policy | MB/s | bundles/s | ack p50 ms | ack p99 ms "
            "| daemon CPU µs / bundle | baseline MB/s | baseline p50 / p99 ms "
            "| daemon / baseline (min-max) | reference bundles/s | reference p50 / p99 ms "
            "| reference CPU µs / bundle | daemon / reference bundles/s (min-max) "
            "| daemon CPU (loop) | entries / fsync | ack p50 / p99 ms at half load "
            "| peak RSS MiB (bound) |")
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for r in rows:
        d, b, f = r.get("daemon"), r.get("baseline"), r.get("reference")
        lines.append("| " + " | ".join([
            str(r["producers"]), r["bundle"], r["policy"],
            _cell(d, "{mb_s:.0f}"), _cell(d, "{bundles_s:.0f}"), _cell(d, "{lat_p50_ms:.1f}"),
            _cell(d, "{lat_p99_ms:.1f}"), _cell(d, "{cpu_us_per_bundle:.0f}"),
            _cell(b, "{mb_s:.0f}"), _cell(b, "{lat_p50_ms:.1f} / {lat_p99_ms:.1f}"),
            _ratio_text(r, "ratio"),
            _cell(f, "{bundles_s:.0f}"), _cell(f, "{lat_p50_ms:.1f} / {lat_p99_ms:.1f}"),
            _cell(f, "{cpu_us_per_bundle:.0f}"), _ratio_text(r, "floor_ratio"),
            _cell(r if d else None, "{daemon_cpu_cores:.2f} ({daemon_loop_cpu_cores:.2f})"),
            _cell(r if d else None, "{entries_per_fsync:.1f}"), _paced_cell(r),
            f"{r['daemon_peak_rss_mib']:.0f} ({rss_bound_mib(r['producers']):.0f})"
            if d else "-",
        ]) + " |")
    return "\n".join(lines)


def _cell(values: dict[str, Any] | None, spec: str) -> str:
    return spec.format(**values) if values else "-"


def _paced_cell(r: dict[str, Any]) -> str:
    p = r.get("paced")
    return f"{p['lat_p50_ms']:.1f} / {p['lat_p99_ms']:.1f}" if p else "-"


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 18's targets, for the interval scenarios the sides run allow judging."""
    out = []
    for r in rows:
        if r["policy"] != "interval":
            continue
        who = f"target: {r['producers']} producer(s), {r['bundle']}, interval:"
        if r["bundle"] == "1MiB" and "ratio" in r:
            out.append(f"{who} {_ratio_text(r, 'ratio')} baseline MB/s "
                       f"({_verdict(r['ratio'] >= TARGET_RATIO)} >= {TARGET_RATIO}x)")
        if r["bundle"] != "1MiB" and "floor_ratio" in r:
            out.append(f"{who} {_ratio_text(r, 'floor_ratio')} reference bundles/s "
                       f"({_verdict(r['floor_ratio'] >= TARGET_FLOOR_RATIO)} "
                       f">= {TARGET_FLOOR_RATIO}x)")
        if r["bundle"] != "1MiB" and "daemon" in r:
            us = r["daemon"]["cpu_us_per_bundle"]
            out.append(f"{who} {us:.0f} µs daemon CPU per bundle "
                       f"({'meets' if us <= TARGET_CPU_US_PER_BUNDLE else 'ABOVE'} "
                       f"<= {TARGET_CPU_US_PER_BUNDLE:.0f} µs)")
        if "paced" in r:
            p, bound = r["paced"], rss_bound_mib(r["producers"])
            verdict = "meets" if p["lat_p99_ms"] <= p["target_p99_ms"] else "ABOVE"
            out.append(f"{who} ack p99 at half load {p['lat_p99_ms']:.1f} ms ({verdict} the "
                       f"{p['target_p99_ms']:.0f} ms target); peak RSS "
                       f"{r['daemon_peak_rss_mib']:.0f} MiB (bound {bound:.0f} MiB)")
    return out


def _verdict(ok: bool) -> str:
    return "meets" if ok else "BELOW"


if __name__ == "__main__":
    sys.exit(main())
