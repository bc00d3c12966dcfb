"""End to end: producers -> ``quiverd serve`` -> one subscriber acking everything,
against reading the same segment files directly with pyarrow.

    python bench/e2e.py [--quick] [--json out.json] [--repeat N] [--window N] [--profile DIR]

Per scenario (``segment.max_open_duration_ms`` 100 / 1000 x bundle 64 KiB / 1 MiB),
``--repeat`` pairs of runs, back to back, alternating which goes first:

    delivered  a fresh daemon (2 shards, every other key at its default) with subscriber
               ``bench-e2e`` registered before anything is produced; one subscriber
               process (``quiverd.client.subscribe``) decodes and acks every
               delivery while 2 producer processes (one per shard) send, in phases:
               warm-up (1/16 of the volume, untimed), ``full`` (as fast as the
               producers' in-flight windows allow) and ``paced`` (a fixed, modest rate
               for 4 s). A phase starts once the subscriber holds everything sent before.
               Throughput = payload bytes acked by the subscriber / (first send of the
               phase -> the subscriber's last ack); latency = the subscriber's
               ``time.time_ns()`` on receipt - the bundle's ``ingestion_ts_ns`` (stamped
               by the WAL writer; one host clock).
    stored     warm-up and ``full`` again into a fresh daemon whose subscriber is
               registered but never attaches (nothing is deleted): its producer-side
               rate is **ingest alone**, and delivered / ingest alone is issue 11's
               ratio (target >= 0.8, median of the per-pair ratios); the daemon is stopped
               (SIGTERM seals and finalizes the open segment) and its segment files are
               read: pyarrow over every stream slice (``pa.memory_map`` +
               ``pa.ipc.open_file``, every batch: the baseline), ``SegmentReader`` (CRC of
               each file, every bundle rebuilt), and one plain IPC file holding the same
               batches. Reads: median of 5 after an untimed pass.

See bench/README.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
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
    thread_cpu_s,
)

from quiverd.client.consumer import subscribe  # noqa: E402
from quiverd.client.producer import Client  # noqa: E402
from quiverd.kernel import layout  # noqa: E402
from quiverd.kernel.errors import QuiverError  # noqa: E402
from quiverd.net.admin import request as admin_request  # noqa: E402
from quiverd.segments.reader import SegmentReader  # noqa: E402

SHARDS = 2
PRODUCERS = 2  # one per shard: both dispatchers deliver
SUBSCRIBER = "bench-e2e"
OPEN_DURATIONS_MS = (100, 1000)
BUNDLES = (64 * KiB, 1 * MiB)
VOLUME = {1 * MiB: 512 * MiB, 64 * KiB: 128 * MiB}  # full-speed payload bytes per run
WARMUP_FRACTION = 16
PHASES = ("full", "paced")
# The paced phase: all producers together, well under what delivery sustains here, the
# same load for both open durations, so latency is not queueing behind a backlog.
PACE_MB_S = {1 * MiB: 64, 64 * KiB: 16}
PACED_S = 4.0
READ_REPS = 5  # baseline reads: median of 5 after one untimed pass
# Bound on every wait for another process; E2E_RUN_TIMEOUT_S shortens it when debugging.
RUN_TIMEOUT_S = float(os.environ.get("E2E_RUN_TIMEOUT_S", 300))
DRAIN_TIMEOUT_S = 30.0  # after the last ack, until ack.log holds every ack
# A subscriber that got nothing for this long while the daemon holds finalized bundles
# it has not acked reconnects (attaching wakes every shard's dispatcher), counting a
# stall: one shard's acks do not wake the other shard's dispatcher (bench/README.md).
STALL_S = 5.0
MAX_STALLS = 10
BUSY_CORES = 0.15  # CPU used by other processes during a phase that earns a warning


@dataclass
class Scenario:
    open_ms: int
    bundle_bytes: int
    ipc_bytes: int  # the payload's actual IPC stream length
    per_producer: int
    warmup_per_producer: int
    paced_per_producer: int

    @property
    def size_name(self) -> str:
        return f"{self.bundle_bytes // MiB}MiB" if self.bundle_bytes >= MiB else \
            f"{self.bundle_bytes // KiB}KiB"

    @property
    def name(self) -> str:
        return f"open{self.open_ms}ms-{self.size_name}"

    @property
    def settings(self) -> dict[str, Any]:
        return {"segment.max_open_duration_ms": self.open_ms}

    @property
    def pace_bundles_s(self) -> float:
        """Paced phase, per producer."""
        return PACE_MB_S[self.bundle_bytes] * 1e6 / self.ipc_bytes / PRODUCERS

    def counts(self, producers: int) -> dict[str, tuple[int, float]]:
        """Per phase, (bundles, bundles/s or 0 = unpaced) of ``producers`` producers."""
        return {"warmup": (self.warmup_per_producer * producers, 0.0),
                "full": (self.per_producer * producers, 0.0),
                "paced": (self.paced_per_producer * producers, self.pace_bundles_s * producers)}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    scale = args.scale / 8 if args.quick else args.scale
    paced_s = PACED_S / 4 if args.quick else PACED_S * args.scale
    payloads = {size: make_table(size) for size in BUNDLES}
    scenarios = [_scenario(ms, size, len(payloads[size][1]), scale, paced_s)
                 for size in BUNDLES for ms in OPEN_DURATIONS_MS]
    if args.only:
        scenarios = [s for s in scenarios if s.name in args.only]
    print(f"# quiverd e2e bench: {len(scenarios)} scenarios x {args.repeat} pairs, "
          f"{os.cpu_count()} cores, data under {root} ({filesystem_of(root)}), "
          f"pyarrow {pa.__version__}, subscriber window {args.window}", flush=True)
    results = []
    for scn in scenarios:
        table, ipc = payloads[scn.bundle_bytes]
        pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for rep in range(args.repeat):
            first_delivered = rep % 2 == 0  # page-cache state drifts between runs
            stored = None if first_delivered else run_stored(scn, ipc, table, root)
            spy = Path(args.profile) / f"{scn.name}-{rep}.txt" if args.profile else None
            delivered = run_delivered(scn, ipc, root, args.window, spy)
            if stored is None:
                stored = run_stored(scn, ipc, table, root)
            pairs.append((delivered, stored))
            print(_line(scn, rep, delivered, stored), flush=True)
        results.append(summarize(scn, pairs))
    print()
    print(markdown(results))
    print()
    for r in results:
        print(f"{r['scenario']}: delivered / ingest alone = {r['ratio_ingest_alone']:.2f} "
              f"({r['delivered_mb_s']:.0f} / {r['ingest_mb_s_no_delivery']:.0f} MB/s, "
              f"target >= 0.8); delivered / baseline = {r['ratio']:.4f} "
              f"({r['delivered_mb_s']:.0f} / {r['baseline_mb_s']:.0f} MB/s), "
              f"vs SegmentReader {r['ratio_segment_reader']:.3f}")
    if args.json:
        meta = {"cores": os.cpu_count(), "python": platform.python_version(),
                "pyarrow": pa.__version__, "filesystem": filesystem_of(root),
                "commit": git_head(), "quick": args.quick, "repeat": args.repeat,
                "shards": SHARDS, "producers": PRODUCERS, "window": args.window}
        Path(args.json).write_text(json.dumps({"meta": meta, "runs": results}, indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="1/8 of the volume per run, a 1 s paced phase")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--repeat", type=int, default=2,
                   help="delivered/stored pairs per scenario (default 2)")
    p.add_argument("--only", type=lambda s: s.split(","), metavar="RUN,...",
                   help="run only these scenarios, by name (e.g. open100ms-1MiB)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the volume and the paced phase's length (e.g. 4 for "
                        "long runs to profile)")
    p.add_argument("--window", type=int, default=64,
                   help="subscriber window: deliveries unanswered at a time (default 64, "
                        "the library's default)")
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where fresh data dirs are made (must be the real disk, not tmpfs)")
    p.add_argument("--profile", metavar="DIR",
                   help="attach `py-spy record` to the daemon during each delivered run's "
                        "timed phase (collapsed stacks in DIR/<scenario>-<repeat>.txt)")
    return p


def _scenario(open_ms: int, size: int, ipc_bytes: int, scale: float, paced_s: float
              ) -> Scenario:
    total = int(VOLUME[size] * scale) // size
    per = max(total // PRODUCERS, 1)
    scn = Scenario(open_ms=open_ms, bundle_bytes=size, ipc_bytes=ipc_bytes, per_producer=per,
                   warmup_per_producer=max(per // WARMUP_FRACTION, 2), paced_per_producer=0)
    scn.paced_per_producer = max(round(scn.pace_bundles_s * paced_s), 2)
    return scn


# ---- delivered: producers -> daemon -> subscriber ---------------------------------------
def run_delivered(scn: Scenario, ipc: bytes, root: Path, window: int,
                  spy_out: Path | None) -> dict[str, Any]:
    """Full speed, then paced, into one daemon whose subscriber acks every delivery.

    Each phase starts only once the subscriber holds everything sent before it, so
    neither inherits the other's backlog.
    """
    daemon = Daemon(root, policy="interval", shards=SHARDS, settings=scn.settings)
    ctx = mp.get_context("spawn")  # no fork after pyarrow's threads exist
    starts = [ctx.Barrier(PRODUCERS + 2) for _ in PHASES]  # producers, subscriber, this process
    results: Any = ctx.Queue()
    stop = ctx.Event()
    rows = pa.ipc.open_stream(ipc).read_all().num_rows
    procs = [ctx.Process(target=_subscriber, args=(
        str(daemon.socket), str(daemon.admin_socket), window, scn.counts(PRODUCERS), rows,
        starts, results, stop))]
    procs += [ctx.Process(target=_producer, args=(
        str(daemon.socket), name, ipc, scn.counts(1), PHASES, starts, results))
        for name in client_names(PRODUCERS, SHARDS, scn.name)]
    phases: dict[str, dict[str, Any]] = {}
    try:
        _register_subscriber(daemon)
        for proc in procs:
            proc.start()
        for phase, barrier in zip(PHASES, starts, strict=True):
            spy = spy_out if phase == "full" else None
            phases[phase] = _timed_phase(scn, phase, daemon, barrier, results, len(procs), spy)
        drained_s, lag = _wait_acks_durable(daemon)
        stop.set()
        for proc in procs:
            proc.join(RUN_TIMEOUT_S)
        segments = sum(s["segments_finalized"]
                       for s in admin_request(daemon.admin_socket, "status")["shards"])
    finally:
        stop.set()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        code = daemon.stop()
        tail = daemon.log_tail(5)
        daemon.remove()
    if code != 0:
        raise RuntimeError(f"{scn.name}: quiverd exited with {code}:\n{tail}")
    return {**phases["full"], "paced": phases["paced"], "segments_finalized": segments,
            "acks_durable_after_s": drained_s, "lag_left": lag}


def _timed_phase(scn: Scenario, phase: str, daemon: Daemon, barrier: Any, results: Any,
                 nprocs: int, spy_out: Path | None) -> dict[str, Any]:
    """Release one phase at its barrier, collect every process's report, sum up."""
    try:
        barrier.wait(RUN_TIMEOUT_S)
    except threading.BrokenBarrierError:
        raise RuntimeError(f"{scn.name}: failed before the {phase} phase: "
                           f"{results.get(timeout=10).get('error')}\n"
                           + daemon.log_tail()) from None
    cpu0, foreign0, busy0 = thread_cpu_s(daemon.pid), foreign_cpu_s(os.getpid()), machine_busy_s()
    spy = _start_py_spy(daemon.pid, spy_out) if spy_out is not None else None
    outs = [results.get(timeout=RUN_TIMEOUT_S) for _ in range(nprocs)]
    cpu = cpu_delta(daemon.pid, cpu0, thread_cpu_s(daemon.pid))
    busy = machine_busy_s() - busy0
    foreign = foreign_delta_s(foreign0, foreign_cpu_s(os.getpid()))
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    failed = [o["error"] for o in outs if "error" in o]
    if failed:
        raise RuntimeError(f"{scn.name}, {phase} phase: {failed[0]}\n{daemon.log_tail()}")
    sub = next(o for o in outs if o["role"] == "subscriber")
    prods = [o for o in outs if o["role"] == "producer"]
    start, ingest_end = min(o["t0"] for o in prods), max(o["t1"] for o in prods)
    seconds = sub["t_last"] - start
    payload = sub["bundles"] * scn.ipc_bytes
    return {
        "seconds": seconds, "bundles": sub["bundles"], "payload_bytes": payload,
        "mb_s": payload / seconds / 1e6, "bundles_s": sub["bundles"] / seconds,
        "ingest_mb_s": payload / (ingest_end - start) / 1e6,
        # Last delivery after the last producer ack: ~ open duration + finalize when
        # delivery keeps up, growing with the run when it does not.
        "tail_ms": (sub["t_last"] - ingest_end) * 1e3,
        "latencies_ms": sub["lat_ms"], "duplicates": sub["duplicates"], "stalls": sub["stalls"],
        "daemon_cpu_cores": cpu.total_s / seconds, "daemon_loop_cpu_cores": cpu.main_s / seconds,
        "subscriber_cpu_cores": sub["cpu_s"] / seconds,
        "producer_cpu_cores": sum(o["cpu_s"] for o in prods) / seconds,
        "machine_cpu_cores": busy / seconds,  # 2.0 = both cores busy
        "foreign_cpu_cores": foreign / seconds,
    }


def _register_subscriber(daemon: Daemon) -> None:
    """``subscribers.add`` before anything is produced.

    ``Daemon`` returns once the socket files exist, which is after bind() but possibly
    before listen(): a connection refused right after start is retried, bounded.
    """
    deadline = time.monotonic() + 10.0
    while True:
        try:
            admin_request(daemon.admin_socket, "subscribers.add",
                          {"name": SUBSCRIBER, "start": "earliest"})
            return
        except QuiverError as exc:
            if time.monotonic() > deadline or not isinstance(exc.__cause__,
                                                              ConnectionRefusedError):
                raise
        time.sleep(0.01)


def _wait_acks_durable(daemon: Daemon) -> tuple[float | None, dict[str, Any]]:
    """Seconds until ack.log holds every ack (None if not within the bound), and the lag.

    An external process has no event to wait on: poll the admin socket, bounded.
    """
    t0 = time.perf_counter()
    while True:
        lag = next(s for s in admin_request(daemon.admin_socket, "subscribers.list")
                   if s["name"] == SUBSCRIBER)
        if lag["lag_bundles"] == 0:
            return time.perf_counter() - t0, lag
        if time.perf_counter() - t0 > DRAIN_TIMEOUT_S:
            return None, lag
        time.sleep(0.01)


def _subscriber(socket_path: str, admin_path: str, window: int,
                counts: dict[str, tuple[int, float]], rows: int, starts: list[Any],
                results: Any, stop: Any) -> None:
    """The subscriber process: decode and ack everything; report each phase, then stay
    attached until ``stop`` (so the last acks reach the daemon over a live connection)."""
    try:
        tally = _Tally(counts, rows, starts, results)
        anyio.run(_consume, socket_path, admin_path, window, tally, stop,
                  backend="asyncio", backend_options={"use_uvloop": True})
    except BaseException as exc:  # reported to the parent, which fails the run
        for barrier in starts:
            barrier.abort()
        results.put({"role": "subscriber", "error": repr(exc)})


async def _consume(socket_path: str, admin_path: str, window: int, tally: _Tally,
                   stop: Any) -> None:
    """Subscribe; after ``STALL_S`` without a delivery reconnect, which wakes every
    shard's dispatcher (a stall if the daemon held finalized bundles meanwhile)."""
    while True:
        async with subscribe(socket_path, SUBSCRIBER, window=window) as deliveries:
            outcome = await _take(deliveries, admin_path, tally)
            if outcome == "done":
                await anyio.to_thread.run_sync(stop.wait, RUN_TIMEOUT_S)
                return
        if outcome == "stalled":
            tally.stalls += 1
        if tally.stalls > MAX_STALLS:
            raise RuntimeError(f"delivery stalled {tally.stalls} times; {len(tally.seen)} "
                               "bundles received in all")


async def _take(deliveries: AsyncIterator[Any], admin_path: str, tally: _Tally) -> str:
    """Take deliveries until the last phase is complete ("done") or nothing came for
    ``STALL_S``: "stalled" if the daemon held finalized bundles we had not acked, else
    "idle" (e.g. producers slow to start). A timeout ends the delivery iterator (the
    cancellation runs through it), so both mean: reconnect."""
    stream = aiter(deliveries)
    while True:
        d: Any = None
        with anyio.move_on_after(STALL_S):
            d = await anext(stream, _CLOSED)
        if d is _CLOSED:
            raise ConnectionError("quiverd closed the subscriber connection")
        if d is None:
            lag = await anyio.to_thread.run_sync(_lag_bundles, admin_path)
            return "stalled" if lag > 0 else "idle"
        now_ns = time.time_ns()
        got = sum(t.num_rows for t in d.tables.values())  # decode, as a consumer would
        await d.ack()
        if got != tally.rows:
            raise AssertionError(f"bundle {d.id}: {got} rows, sent {tally.rows}")
        if not await tally.add(d.id, now_ns - d.ingestion_ts_ns):
            return "done"


def _lag_bundles(admin_path: str) -> int:
    subs = admin_request(admin_path, "subscribers.list")
    return sum(s["lag_bundles"] for s in subs if s["name"] == SUBSCRIBER)


_CLOSED = object()


class _Tally:
    """The subscriber's count of distinct bundles; reports each phase as it completes.

    Phase boundaries are counts: a phase's bundles are only sent once the subscriber met
    the others at its barrier, i.e. holds every bundle of the phases before.
    """

    def __init__(self, counts: dict[str, tuple[int, float]], rows: int, starts: list[Any],
                 results: Any) -> None:
        self.rows, self.results = rows, results
        self.ends = list(itertools.accumulate(counts[p][0] for p in ("warmup", *PHASES)))
        self.phases = iter(zip(PHASES, starts, strict=True))
        self.seen: set[tuple[int, int, int]] = set()  # bounded by the run's volume
        self.phase, self.duplicates, self.cpu0 = "", 0, 0.0
        self.lat_ms: list[float] = []
        self.stalls = 0  # counted in the phase they happen in

    async def add(self, bundle_id: tuple[int, int, int], latency_ns: int) -> bool:
        """Count one delivery; False once the last phase is complete."""
        if bundle_id in self.seen:
            self.duplicates += 1  # at least once: a reconnect redelivers the unacked
            return True
        self.seen.add(bundle_id)
        if self.phase:
            self.lat_ms.append(latency_ns / 1e6)
        if len(self.seen) not in self.ends:
            return True
        if self.phase:
            self.results.put({"role": "subscriber", "phase": self.phase,
                              "t_last": time.perf_counter(), "bundles": len(self.lat_ms),
                              "lat_ms": self.lat_ms, "duplicates": self.duplicates,
                              "stalls": self.stalls, "cpu_s": _own_cpu_s() - self.cpu0})
        nxt = next(self.phases, None)
        if nxt is None:
            return False
        self.phase, barrier = nxt
        self.lat_ms, self.duplicates, self.stalls = [], 0, 0
        await anyio.to_thread.run_sync(barrier.wait, RUN_TIMEOUT_S)
        self.cpu0 = _own_cpu_s()
        return True


def _producer(socket_path: str, name: str, ipc: bytes, counts: dict[str, tuple[int, float]],
              phases: tuple[str, ...], starts: list[Any], results: Any) -> None:
    """One producer process: warm up, then per phase wait for the others and send."""
    try:
        table = pa.ipc.open_stream(ipc).read_all()
        with Client.connect(socket_path) as client:
            for _ in client.iter_send(itertools.repeat(table, counts["warmup"][0]), client=name):
                pass
            for phase, barrier in zip(phases, starts, strict=True):
                bundles, rate = counts[phase]
                barrier.wait(RUN_TIMEOUT_S)
                cpu0, t0 = _own_cpu_s(), time.perf_counter()
                sent = sum(1 for _ in client.iter_send(_paced(table, bundles, rate),
                                                       client=name))
                t1 = time.perf_counter()
                results.put({"role": "producer", "phase": phase, "t0": t0, "t1": t1,
                             "bundles": sent, "cpu_s": _own_cpu_s() - cpu0})
    except BaseException as exc:  # reported to the parent, which fails the run
        for barrier in starts:
            barrier.abort()
        results.put({"role": "producer", "error": repr(exc)})


def _paced(table: pa.Table, count: int, bundles_s: float) -> Iterator[pa.Table]:
    """``table`` ``count`` times, the k-th not before start + k / ``bundles_s``
    (0 = as fast as the client's in-flight window allows)."""
    t0 = time.perf_counter()
    for k in range(count):
        delay = t0 + k / bundles_s - time.perf_counter() if bundles_s else 0.0
        if delay > 0:
            time.sleep(delay)
        yield table


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = os.environ.get("PY_SPY_FLAGS", "").split()  # e.g. "--idle", "--gil"
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--rate", "250", "--threads",
         "--format", "raw", "--output", str(out), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# ---- stored: the same data, segment files read directly ------------------------------
def run_stored(scn: Scenario, ipc: bytes, table: pa.Table, root: Path) -> dict[str, Any]:
    """Warm-up and full-speed phase again, with a subscriber that is registered but
    never attaches (nothing is deleted); stop the daemon, read its segment files."""
    daemon = Daemon(root, policy="interval", shards=SHARDS, settings=scn.settings)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(PRODUCERS + 1)
    results: Any = ctx.Queue()
    procs = []
    try:
        _register_subscriber(daemon)
        procs = [ctx.Process(target=_producer, args=(
            str(daemon.socket), name, ipc, scn.counts(1), ("full",), [barrier], results))
            for name in client_names(PRODUCERS, SHARDS, scn.name)]
        for proc in procs:
            proc.start()
        try:
            barrier.wait(RUN_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"{scn.name}: producer failed: "
                               f"{results.get(timeout=10).get('error')}") from None
        outs = [results.get(timeout=RUN_TIMEOUT_S) for _ in procs]
        failed = [o["error"] for o in outs if "error" in o]
        if failed:
            raise RuntimeError(f"{scn.name}: {failed[0]}\n{daemon.log_tail()}")
        for proc in procs:
            proc.join(RUN_TIMEOUT_S)
        code = daemon.stop()  # seals and finalizes the open segment
        if code != 0:
            raise RuntimeError(f"{scn.name}: quiverd exited with {code}:\n{daemon.log_tail()}")
        data = layout.DataDir(daemon.data_dir)
        files = sorted(p for i in range(SHARDS) for p in data.shard(i).segments_dir.iterdir()
                       if layout.segment_seq_of(p.name) is not None)
        return _read_all_ways(scn, files, table, len(ipc), daemon.dir, outs)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        daemon.stop()
        daemon.remove()


def _read_all_ways(scn: Scenario, files: list[Path], table: pa.Table, ipc_len: int,
                   scratch: Path, outs: list[dict[str, Any]]) -> dict[str, Any]:
    expected = PRODUCERS * (scn.warmup_per_producer + scn.per_producer)
    slices = _stream_slices(files)
    bundles = read_segment_reader(files)
    if bundles != expected:
        raise AssertionError(f"{scn.name}: segments hold {bundles} bundles, sent {expected}")
    rows = expected * table.num_rows
    plain = scratch / "plain.arrow"
    with pa.OSFile(str(plain), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for _ in range(expected):
            writer.write_table(table)
    sides: dict[str, Callable[[], int]] = {
        "pyarrow_slices": lambda: read_slices(slices),
        "segment_reader": lambda: read_segment_reader(files) * table.num_rows,
        "plain_ipc": lambda: read_plain(plain),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    for rep in range(READ_REPS + 1):  # rep 0 is the untimed pass
        for side, fn in sides.items():
            t0 = time.perf_counter()
            got = fn()
            if rep:
                times[side].append(time.perf_counter() - t0)
            elif got != rows:
                raise AssertionError(f"{scn.name}: {side} read {got} rows, expected {rows}")
    payload = expected * ipc_len
    start = min(o["t0"] for o in outs)
    ingest_s = max(o["t1"] for o in outs) - start
    return {
        "segment_files": len(files), "file_bytes": sum(f.stat().st_size for f in files),
        "bundles": expected, "payload_bytes": payload,
        "ingest_mb_s": PRODUCERS * scn.per_producer * ipc_len / ingest_s / 1e6,
        **{f"{side}_mb_s": payload / statistics.median(ts) / 1e6 for side, ts in times.items()},
        "read_ms": {side: [t * 1e3 for t in ts] for side, ts in times.items()},
    }


def _stream_slices(files: list[Path]) -> list[tuple[str, list[tuple[int, int]]]]:
    """(path, [(offset, length) of every stream]) per file, from the segment directory
    (untimed: the baseline reads bytes, not quiverd's footer)."""
    out = []
    for path in files:
        with SegmentReader.open(path) as reader:
            d = reader.directory
            out.append((str(path), list(zip(d.column("byte_offset").to_pylist(),
                                            d.column("byte_length").to_pylist(), strict=True))))
    return out


def read_slices(slices: list[tuple[str, list[tuple[int, int]]]]) -> int:
    """The baseline: map each file, open every stream slice as an IPC file, every batch."""
    rows = 0
    for path, streams in slices:
        with pa.memory_map(path) as source:
            data = source.read_buffer()
            for offset, length in streams:
                reader = pa.ipc.open_file(data.slice(offset, length))
                rows += sum(reader.get_batch(i).num_rows
                            for i in range(reader.num_record_batches))
    return rows


def read_segment_reader(files: list[Path]) -> int:
    """Every bundle through quiverd's reader (CRC of each file, bundles rebuilt)."""
    bundles = 0
    for path in files:
        with SegmentReader.open(path) as reader:
            bundles += sum(1 for _ in reader.bundles())
    return bundles


def read_plain(path: Path) -> int:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all().num_rows


# ---- report ---------------------------------------------------------------------------
def summarize(scn: Scenario, pairs: list[tuple[dict[str, Any], dict[str, Any]]]
              ) -> dict[str, Any]:
    """Medians over repeats; latency percentiles pooled over every bundle of every repeat."""
    dl = [d for d, _ in pairs]
    pc = [d["paced"] for d in dl]
    st = [s for _, s in pairs]

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    def lat(runs: list[dict[str, Any]]) -> dict[str, float]:
        ms = sorted(itertools.chain.from_iterable(r["latencies_ms"] for r in runs))
        return {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": ms[-1]}

    return {
        "scenario": scn.name, "open_ms": scn.open_ms, "bundle": scn.size_name,
        "bundle_ipc_bytes": scn.ipc_bytes, "bundles_full": PRODUCERS * scn.per_producer,
        "bundles_paced": PRODUCERS * scn.paced_per_producer,
        "delivered_mb_s": med(dl, "mb_s"), "delivered_bundles_s": med(dl, "bundles_s"),
        "tail_ms": med(dl, "tail_ms"), "lat_full_ms": lat(dl),
        "paced_target_mb_s": PACE_MB_S[scn.bundle_bytes], "paced_mb_s": med(pc, "mb_s"),
        "paced_tail_ms": med(pc, "tail_ms"), "lat_paced_ms": lat(pc),
        "ingest_mb_s_with_delivery": med(dl, "ingest_mb_s"),
        "ingest_mb_s_no_delivery": med(st, "ingest_mb_s"),
        "baseline_mb_s": med(st, "pyarrow_slices_mb_s"),
        "segment_reader_mb_s": med(st, "segment_reader_mb_s"),
        "plain_ipc_mb_s": med(st, "plain_ipc_mb_s"),
        "ratio": statistics.median(d["mb_s"] / s["pyarrow_slices_mb_s"] for d, s in pairs),
        # Issue 11's target (>= 0.8): delivered with one subscriber against the same
        # producers into the same daemon config with no subscriber attached.
        "ratio_ingest_alone": statistics.median(d["mb_s"] / s["ingest_mb_s"] for d, s in pairs),
        "ratio_segment_reader": statistics.median(d["mb_s"] / s["segment_reader_mb_s"]
                                                  for d, s in pairs),
        "segment_files_stored": med(st, "segment_files"),
        "stalls": sum(d["stalls"] + d["paced"]["stalls"] for d in dl),
        "daemon_cpu_cores": med(dl, "daemon_cpu_cores"),
        "daemon_loop_cpu_cores": med(dl, "daemon_loop_cpu_cores"),
        "subscriber_cpu_cores": med(dl, "subscriber_cpu_cores"),
        "machine_cpu_cores": med(dl, "machine_cpu_cores"),
        "foreign_cpu_cores": max(max(d["foreign_cpu_cores"], d["paced"]["foreign_cpu_cores"])
                                 for d in dl),
        "delivered": [_strip(d) for d in dl],
        "stored": st,
    }


def _strip(run: dict[str, Any]) -> dict[str, Any]:
    """A run for the JSON: latency lists reduced to percentiles."""
    out = {k: v for k, v in run.items() if k not in ("latencies_ms", "paced")}
    ms = sorted(run["latencies_ms"])
    out["lat_ms"] = {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": ms[-1]}
    if "paced" in run:
        out["paced"] = _strip(run["paced"])
    return out


def _line(scn: Scenario, rep: int, d: dict[str, Any], s: dict[str, Any]) -> str:
    full, paced = sorted(d["latencies_ms"]), sorted(d["paced"]["latencies_ms"])
    drained = "never" if d["acks_durable_after_s"] is None else \
        f"{d['acks_durable_after_s'] * 1e3:.0f} ms"
    dup = d["duplicates"] + d["paced"]["duplicates"]
    stalls = d["stalls"] + d["paced"]["stalls"]
    others = max(d["foreign_cpu_cores"], d["paced"]["foreign_cpu_cores"])
    return (f"{scn.name:>16} #{rep}: delivered {d['mb_s']:4.0f} MB/s {d['bundles_s']:4.0f} b/s, "
            f"tail {d['tail_ms']:4.0f} ms, lat p50/p99 {percentile(full, 50):.0f}/"
            f"{percentile(full, 99):.0f} ms; paced {d['paced']['mb_s']:.0f} MB/s: "
            f"{percentile(paced, 50):.0f}/{percentile(paced, 99):.0f} ms "
            f"| ingest {d['ingest_mb_s']:.0f} vs {s['ingest_mb_s']:.0f} MB/s without subscriber "
            f"(delivered / ingest alone {d['mb_s'] / s['ingest_mb_s']:.2f}) "
            f"| {d['segments_finalized']} segments, acks durable +{drained}, {dup} dup "
            f"| read {s['segment_files']} files: slices {s['pyarrow_slices_mb_s']:.0f}, "
            f"SegmentReader {s['segment_reader_mb_s']:.0f}, plain {s['plain_ipc_mb_s']:.0f} MB/s "
            f"| cpu daemon {d['daemon_cpu_cores']:.2f} (loop {d['daemon_loop_cpu_cores']:.2f}) "
            f"sub {d['subscriber_cpu_cores']:.2f} prod {d['producer_cpu_cores']:.2f} "
            f"machine {d['machine_cpu_cores']:.2f}"
            + (f", OTHERS {others:.2f}" if others > BUSY_CORES else "")
            + (f" | {stalls} STALL(S): {STALL_S:.0f} s each in the figures" if stalls else ""))


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| open ms | bundle | delivered MB/s | bundles/s | delivered / ingest alone | tail ms "
            "| latency p50 / p99 ms | paced MB/s | paced latency p50 / p99 ms "
            "| ingest MB/s with / without subscriber | baseline MB/s (pyarrow slices) "
            "| SegmentReader MB/s | plain IPC file MB/s | delivered / baseline "
            "| daemon CPU (loop) | machine CPU |")
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for r in rows:
        full, paced = r["lat_full_ms"], r["lat_paced_ms"]
        lines.append(
            f"| {r['open_ms']} | {r['bundle']} | {r['delivered_mb_s']:.0f}"
            f"{' (stalled)' if r['stalls'] else ''} "
            f"| {r['delivered_bundles_s']:.0f} | {r['ratio_ingest_alone']:.2f} "
            f"| {r['tail_ms']:.0f} "
            f"| {full['p50']:.0f} / {full['p99']:.0f} | {r['paced_mb_s']:.0f} "
            f"| {paced['p50']:.0f} / {paced['p99']:.0f} "
            f"| {r['ingest_mb_s_with_delivery']:.0f} / {r['ingest_mb_s_no_delivery']:.0f} "
            f"| {r['baseline_mb_s']:.0f} | {r['segment_reader_mb_s']:.0f} "
            f"| {r['plain_ipc_mb_s']:.0f} | {r['ratio']:.4f} "
            f"| {r['daemon_cpu_cores']:.2f} ({r['daemon_loop_cpu_cores']:.2f}) "
            f"| {r['machine_cpu_cores']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
