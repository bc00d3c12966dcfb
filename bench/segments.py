"""Segment finalize, segment read, and end-to-end ingest with segments on vs off.

    python bench/segments.py [--quick] [--json out.json] [--only PART,...] [--profile DIR]
                             [--bundle-kib 1024,64] [--runs N] [--payloads ingest]

1. finalize  128 logs-like bundles of ~256 KiB (32 MiB of IPC) in one ``OpenSegment``;
             timed: ``encode_segment`` (into a warm ``Arena``, as the finalizer) +
             ``write_segment`` (tmp, fsync, rename, fsync dir).
             Baseline: the same decoded record batches through ``pa.ipc.new_file`` into
             one file, with and without fsync (for changing dictionaries the baseline
             must unify them first: an IPC file holds one dictionary per column).
2. read      ``SegmentReader.open`` + every bundle of ``.bundles()`` over the files of 1,
             against ``pa.ipc.open_file(pa.memory_map(...)).read_all()`` (and a
             ``get_batch(i)`` loop) over the baseline files.
3. ingest    ``quiverd serve``, 2 shards, 4 producers, 1 MiB bundles (``--bundle-kib``:
             other sizes, same volume), interval flush:
             acked MB/s with default segment settings (on) vs nothing finalizing during
             the run (off: huge target size and open duration). Both runs use the same
             WAL config, big enough to hold the whole run.

1 and 2 run an untimed warm-up first and report the median of 15 repetitions. 3 starts
with one untimed daemon run, then alternates 5 on and 5 off runs per payload (each
after a warm-up of 1/16 of its volume) and reports medians; a run during which other
processes used more than 0.15 cores is flagged as disturbed and left out of the
medians when at least two undisturbed runs remain. See bench/README.md.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing as mp
import os
import platform
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    KiB,
    MiB,
    client_names,
    cpu_delta,
    filesystem_of,
    git_head,
    make_table,
    thread_cpu_s,
)
from _segments_common import (  # noqa: E402
    configured_daemon,
    logs_batches,
    others_cpu_s,
    process_cpu_s,
    producer,
)

from quiverd.kernel.bundle import Bundle, encode_ipc_stream, make_slot  # noqa: E402
from quiverd.kernel.config import SegmentConfig  # noqa: E402
from quiverd.kernel.layout import segment_path  # noqa: E402
from quiverd.net.admin import request as admin_request  # noqa: E402
from quiverd.segments.files import write_segment  # noqa: E402
from quiverd.segments.format import Arena, encode_segment  # noqa: E402
from quiverd.segments.open_segment import OpenSegment  # noqa: E402
from quiverd.segments.reader import SegmentReader  # noqa: E402

SEGMENT_BYTES = 32 * MiB
BUNDLE_BYTES = 256 * KiB
MAX_CARDINALITY = SegmentConfig().max_dictionary_cardinality
TARGET_RATIO = 0.8
SHARDS = 2
PRODUCERS = 4
E2E_BUNDLE = 1 * MiB
E2E_VOLUME = 512 * MiB  # payload bytes per e2e run (the ingest bench's 1 MiB volume)
E2E_RUNS = 5  # per payload and mode, alternating on/off
E2E_WAL = {"flush_policy": "interval", "max_size_bytes": 4096 * MiB}
SEGMENTS_ON: dict[str, Any] = {}  # every [segment] key at its default
SEGMENTS_OFF = {"target_size_bytes": 1 << 50, "max_open_duration_ms": 1 << 40}
RUN_TIMEOUT_S = 300.0
PARTS = ("finalize", "read", "ingest")
DISTURBED_CORES = 0.15  # CPU used by other processes during an e2e run that flags it
BUSY_WARNING = 0.1  # CPU fraction used by others before the start that earns a warning


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root = Path(args.dir).resolve()
    work = Path(tempfile.mkdtemp(prefix="qsb-", dir=root))
    reps = 5 if args.quick else 15
    print(f"# quiverd segments bench: {os.cpu_count()} cores, data under {root} "
          f"({filesystem_of(root)}), pyarrow {pa.__version__}", flush=True)
    others = other_load()
    if others > BUSY_WARNING:
        print(f"# WARNING: {others:.0%} of the CPU was busy before starting: other work "
              "on this machine makes every figure below slower and noisier", flush=True)
    try:
        fin_rows: list[dict[str, Any]] = []
        read_rows: list[dict[str, Any]] = []
        e2e_rows: list[dict[str, Any]] = []
        for changing in (False, True) if {"finalize", "read"} & set(args.only) else ():
            case = Case.build(changing)
            fin = bench_finalize(case, work, reps, args.profile)
            fin_rows.append(fin)
            print(_fin_line(fin), flush=True)
            if "read" in args.only:
                rd = bench_read(case, reps, args.profile)
                read_rows.append(rd)
                print(_read_line(rd), flush=True)
        if "ingest" in args.only:
            for kib in args.bundle_kib:
                e2e_rows += bench_e2e(root, quick=args.quick, profile_dir=args.profile,
                                      bundle_bytes=kib * KiB, runs=args.runs,
                                      payloads=args.payloads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(markdown(fin_rows, read_rows, e2e_rows))
    print()
    for r in fin_rows:
        print(f"target: finalize ({r['case']}) {r['ratio_fsync']:.2f}x the fsync'd baseline "
              f"({_verdict(r['ratio_fsync'])})")
    for r in e2e_rows:
        print(f"target: ingest with segments on ({r['payload']}) {r['ratio']:.2f}x off "
              f"({_verdict(r['ratio'])})")
    if args.json:
        meta = {"cores": os.cpu_count(), "python": platform.python_version(),
                "pyarrow": pa.__version__, "filesystem": filesystem_of(root),
                "commit": git_head(), "quick": args.quick, "repetitions": reps,
                "busy_before_start": others}
        Path(args.json).write_text(json.dumps(
            {"meta": meta, "finalize": fin_rows, "read": read_rows, "ingest": e2e_rows},
            indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="5 repetitions instead of 15; e2e: 1/8 of the volume, one run each")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--only", type=lambda s: s.split(","), default=list(PARTS),
                   metavar="PART,...", help="run only these parts: finalize,read,ingest "
                   "(read needs finalize's files, so it runs finalize too)")
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where files and data dirs are made (the real disk, not tmpfs)")
    p.add_argument("--profile", metavar="DIR",
                   help="cProfile each finalize (DIR/finalize-<case>.pstats) and attach "
                        "`py-spy record` to each e2e daemon (DIR/ingest-<run>.txt)")
    p.add_argument("--bundle-kib", type=lambda s: [int(x) for x in s.split(",")],
                   default=[E2E_BUNDLE // KiB], metavar="KIB,...",
                   help="ingest: bundle sizes in KiB, one table row each (default 1024)")
    p.add_argument("--runs", type=int, default=None,
                   help=f"ingest: runs per payload and mode (default {E2E_RUNS}, --quick 1)")
    p.add_argument("--payloads", choices=("all", "ingest"), default="all",
                   help="ingest: 'ingest' runs only the int64+utf8 payload of bench/ingest.py")
    return p


def other_load(seconds: float = 1.0) -> float:
    """Fraction of all cores busy over ``seconds`` while this process sleeps (/proc/stat)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


def _verdict(ratio: float) -> str:
    return f"meets the {TARGET_RATIO}x target" if ratio >= TARGET_RATIO else \
        f"BELOW the {TARGET_RATIO}x target"


# ---- 1. finalize ----------------------------------------------------------------------
class Case:
    """One segment's worth of bundles, already in an ``OpenSegment``."""

    def __init__(self, name: str, bundles: list[Bundle], segment: OpenSegment,
                 add_s: float) -> None:
        self.name, self.bundles, self.segment, self.add_s = name, bundles, segment, add_s
        stream = segment.streams[0]
        self.schema: pa.Schema = stream.schemas[0]
        self.batches: list[pa.RecordBatch] = stream.batches  # decoded, zero copy
        self.changing = name.startswith("changing")
        self.seg_path: Path | None = None
        self.base_path: Path | None = None

    @classmethod
    def build(cls, changing: bool) -> Case:
        count = SEGMENT_BYTES // BUNDLE_BYTES
        batches = logs_batches(count, BUNDLE_BYTES, changing=changing)
        now = time.time_ns()
        bundles = [Bundle(client="bench-segments", slots=(make_slot(0, b),),
                          ingestion_ts_ns=now + i * 1000, sequence=i + 1)
                   for i, b in enumerate(batches)]
        segment = OpenSegment()
        t0 = time.perf_counter()
        for b in bundles:
            segment.add(b)
        add_s = time.perf_counter() - t0
        name = "changing dicts" if changing else "stable dicts"
        return cls(name, bundles, segment, add_s)

    @property
    def payload_bytes(self) -> int:
        return self.segment.bytes


ARENA = Arena()  # as the finalizer does: one warm arena, reused segment after segment


def finalize_quiverd(case: Case, path: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    pieces = encode_segment(case.segment, max_dictionary_cardinality=MAX_CARDINALITY,
                            arena=ARENA)
    t1 = time.perf_counter()
    write_segment(path, pieces)
    t2 = time.perf_counter()
    return {"total": t2 - t0, "encode": t1 - t0, "write": t2 - t1}


def finalize_baseline(case: Case, path: Path, *, fsync: bool) -> dict[str, float]:
    t0 = time.perf_counter()
    schema, batches = case.schema, case.batches
    if case.changing:
        # An IPC file allows one dictionary per column: any writer must unify first.
        table = pa.Table.from_batches(batches, schema=schema).unify_dictionaries()
        schema, batches = table.schema, table.to_batches()
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    t1 = time.perf_counter()
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # fsync flushes the inode's dirty pages, whichever fd wrote them
        finally:
            os.close(fd)
    t2 = time.perf_counter()
    return {"total": t2 - t0, "encode": t1 - t0, "write": t2 - t1}


def bench_finalize(case: Case, work: Path, reps: int, profile_dir: str | None
                   ) -> dict[str, Any]:
    tag = case.name.split()[0]
    sides: dict[str, Callable[[Path], dict[str, float]]] = {
        "quiverd": lambda p: finalize_quiverd(case, p),
        "baseline_fsync": lambda p: finalize_baseline(case, p, fsync=True),
        "baseline_nofsync": lambda p: finalize_baseline(case, p, fsync=False),
    }
    times: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
    names = list(sides)
    for rep in range(reps + 1):  # rep 0 is the untimed warm-up
        order = names[rep % 3:] + names[:rep % 3]  # rotate: no side always goes first
        for side in order:
            path = work / f"{tag}-{side}-{rep}.{'qseg' if side == 'quiverd' else 'arrow'}"
            t = sides[side](path)
            if rep:
                times[side].append(t)
            last = rep == reps
            if last and side == "quiverd":
                case.seg_path = path
            elif last and side == "baseline_fsync":
                case.base_path = path
            else:
                path.unlink()
    if profile_dir:
        scratch = segment_path(work, 1)
        _profile(lambda: finalize_quiverd(case, scratch),
                 Path(profile_dir) / f"finalize-{tag}.pstats")
        scratch.unlink()
    mb = case.payload_bytes / 1e6
    med = {side: {k: statistics.median(t[k] for t in ts) for k in ts[0]}
           for side, ts in times.items()}
    assert case.seg_path is not None and case.base_path is not None
    return {
        "case": case.name, "bundles": len(case.bundles), "payload_bytes": case.payload_bytes,
        "rows": sum(b.num_rows for b in case.batches),
        "segment_file_bytes": case.seg_path.stat().st_size,
        "baseline_file_bytes": case.base_path.stat().st_size,
        "add_ms": case.add_s * 1e3,
        "median_ms": {side: {k: v * 1e3 for k, v in m.items()} for side, m in med.items()},
        "mb_s": {side: mb / m["total"] for side, m in med.items()},
        "ratio_fsync": med["baseline_fsync"]["total"] / med["quiverd"]["total"],
        "ratio_nofsync": med["baseline_nofsync"]["total"] / med["quiverd"]["total"],
        "all_ms": {side: [t["total"] * 1e3 for t in ts] for side, ts in times.items()},
    }


def _profile(fn: Callable[[], object], out: Path) -> None:
    """cProfile one call of ``fn``: DIR/<name>.pstats plus a text summary beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    prof.dump_stats(out)
    with open(out.with_suffix(".txt"), "w") as f:
        stats = pstats.Stats(prof, stream=f)
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_stats(30)


def _fin_line(r: dict[str, Any]) -> str:
    m, s = r["median_ms"], r["mb_s"]
    return (f"finalize {r['case']:>14}: quiverd {s['quiverd']:6.0f} MB/s "
            f"({m['quiverd']['encode']:.1f} ms encode + {m['quiverd']['write']:.1f} ms write) "
            f"| new_file+fsync {s['baseline_fsync']:6.0f} MB/s "
            f"| new_file {s['baseline_nofsync']:6.0f} MB/s "
            f"| ratio {r['ratio_fsync']:.2f} (no fsync {r['ratio_nofsync']:.2f}) "
            f"| add() {r['add_ms']:.1f} ms")


# ---- 2. read --------------------------------------------------------------------------
def read_segment(path: Path) -> int:
    bundles = 0
    with SegmentReader.open(path) as reader:
        for bundle in reader.bundles():
            bundles += len(bundle.slots)
    return bundles


def read_baseline_all(path: Path) -> int:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all().num_rows


def read_baseline_loop(path: Path) -> int:
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_file(source)
        return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def check_roundtrip(case: Case) -> None:
    """Untimed: every bundle reads back exactly as it was added (else the figures lie)."""
    assert case.seg_path is not None and case.base_path is not None
    with SegmentReader.open(case.seg_path) as reader:
        for sent, got in zip(case.bundles, reader.bundles(), strict=True):
            expected = pa.ipc.open_stream(sent.slots[0].ipc).read_all()
            if not got.slots[0].equals(expected) or got.sequence != sent.sequence:
                raise AssertionError(f"{case.name}: bundle {got.index} read back differently")
    with pa.memory_map(str(case.base_path)) as source:
        if pa.ipc.open_file(source).read_all().num_rows != sum(b.num_rows for b in case.batches):
            raise AssertionError(f"{case.name}: baseline file lost rows")


def bench_read(case: Case, reps: int, profile_dir: str | None) -> dict[str, Any]:
    assert case.seg_path is not None and case.base_path is not None
    check_roundtrip(case)
    sides: dict[str, Callable[[], int]] = {
        "quiverd": lambda: read_segment(case.seg_path),  # type: ignore[arg-type]
        "baseline_read_all": lambda: read_baseline_all(case.base_path),  # type: ignore[arg-type]
        "baseline_get_batch": lambda: read_baseline_loop(case.base_path),  # type: ignore[arg-type]
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    for rep in range(reps + 1):
        for side, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[side].append(time.perf_counter() - t0)
    if profile_dir:
        _profile(sides["quiverd"], Path(profile_dir) / f"read-{case.name.split()[0]}.pstats")
    med = {side: statistics.median(ts) for side, ts in times.items()}
    n, mb = len(case.bundles), case.payload_bytes / 1e6
    return {
        "case": case.name, "bundles": n, "payload_bytes": case.payload_bytes,
        "median_ms": {side: v * 1e3 for side, v in med.items()},
        "bundles_s": {side: n / v for side, v in med.items()},
        "mb_s": {side: mb / v for side, v in med.items()},
        "ratio_read_all": med["baseline_read_all"] / med["quiverd"],
        "ratio_get_batch": med["baseline_get_batch"] / med["quiverd"],
    }


def _read_line(r: dict[str, Any]) -> str:
    b, s = r["bundles_s"], r["mb_s"]
    return (f"read     {r['case']:>14}: SegmentReader {b['quiverd']:8.0f} bundles/s "
            f"{s['quiverd']:7.0f} MB/s | read_all {s['baseline_read_all']:7.0f} MB/s "
            f"| get_batch loop {b['baseline_get_batch']:8.0f} b/s | ratio "
            f"{r['ratio_read_all']:.2f} (vs loop {r['ratio_get_batch']:.2f})")


# ---- 3. end-to-end ingest -------------------------------------------------------------
def bench_e2e(root: Path, *, quick: bool, profile_dir: str | None,
              bundle_bytes: int = E2E_BUNDLE, runs: int | None = None,
              payloads: str = "all") -> list[dict[str, Any]]:
    """Per payload: alternate segments on/off runs; report medians and their ratio."""
    _, ingest_ipc = make_table(bundle_bytes)
    size = f"{bundle_bytes // MiB} MiB" if bundle_bytes >= MiB else f"{bundle_bytes // KiB} KiB"
    cases = {f"int64+utf8 (ingest bench), {size}": [ingest_ipc]}
    if payloads == "all":
        cases[f"logs, changing dicts, {size}"] = [
            encode_ipc_stream(b) for b in logs_batches(16, bundle_bytes, changing=True, seed=11)]
    if runs is None:
        runs = 1 if quick else E2E_RUNS
    volume = E2E_VOLUME // (8 if quick else 1)
    # The first daemon after a pause runs on memory the VM has not touched lately and
    # is often far slower (shared/NOTES.md): one untimed run, so neither mode pays it.
    warm = run_e2e(root, [ingest_ipc], "on", volume // 4, None)
    print(f"ingest warm-up run (not counted): {warm['mb_s']:.0f} MB/s", flush=True)
    rows = []
    for name, ipcs in cases.items():
        got: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        for i in range(runs):
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                tag = f"{name.split()[0].rstrip(',')}-{bundle_bytes // KiB}k-{mode}-{i}"
                spy = Path(profile_dir) / f"ingest-{tag}.txt" if profile_dir else None
                r = run_e2e(root, ipcs, mode, volume, spy)
                got[mode].append(r)
                print(f"ingest {name:>26} segments {mode:>3} run {i}: {r['mb_s']:6.0f} MB/s, "
                      f"{r['segments_finalized']} segments finalized in the timed window, "
                      f"daemon cpu {r['daemon_cpu_cores']:.2f} cores "
                      f"({r['daemon_cpu_us_per_bundle']:.0f} µs/bundle) "
                      f"(loop {r['daemon_loop_cpu_cores']:.2f}), producers "
                      f"{r['producer_cpu_cores']:.2f}"
                      + (f", DISTURBED: others used {r['other_cpu_cores']:.2f} cores"
                         if r["other_cpu_cores"] > DISTURBED_CORES else ""), flush=True)
        counted = {mode: _counted(runs_) for mode, runs_ in got.items()}
        on = statistics.median(r["mb_s"] for r in counted["on"])
        off = statistics.median(r["mb_s"] for r in counted["off"])
        rows.append({"payload": name, "bundle_ipc_bytes": len(ipcs[0]), "on_mb_s": on,
                     "off_mb_s": off, "ratio": on / off, "runs": got,
                     "counted": {mode: len(c) for mode, c in counted.items()}})
    return rows


def _counted(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs a median is taken over: the undisturbed ones if there are two or more."""
    calm = [r for r in runs if r["other_cpu_cores"] <= DISTURBED_CORES]
    return calm if len(calm) >= 2 else runs


def run_e2e(root: Path, ipcs: list[bytes], mode: str, volume: int, spy_out: Path | None
            ) -> dict[str, Any]:
    segment = SEGMENTS_ON if mode == "on" else SEGMENTS_OFF
    daemon = configured_daemon(root, shards=SHARDS, wal=E2E_WAL, segment=segment)
    per = max(volume // len(ipcs[0]) // PRODUCERS, 1)
    warm = max(per // 16, 2)
    ctx = mp.get_context("spawn")  # no fork after pyarrow's threads exist
    barrier = ctx.Barrier(PRODUCERS + 1)
    results: Any = ctx.Queue()
    names = client_names(PRODUCERS, SHARDS, f"seg-{mode}")
    procs = [ctx.Process(target=producer, args=(str(daemon.socket), name, ipcs, warm, per,
                                                barrier, results)) for name in names]
    spy: subprocess.Popen[bytes] | None = None
    try:
        for proc in procs:
            proc.start()
        try:
            barrier.wait(RUN_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"producer failed: {results.get(timeout=10).get('error')}\n"
                               + daemon.log_tail()) from None
        cpu0, st0 = thread_cpu_s(daemon.pid), admin_request(daemon.admin_socket, "status")
        procs0, wall0 = process_cpu_s(), time.perf_counter()
        if spy_out is not None:
            spy = _start_py_spy(daemon.pid, spy_out)
        outs = [results.get(timeout=RUN_TIMEOUT_S) for _ in procs]
        cpu = cpu_delta(daemon.pid, cpu0, thread_cpu_s(daemon.pid))
        others = others_cpu_s(procs0, process_cpu_s()) / (time.perf_counter() - wall0)
        st1 = admin_request(daemon.admin_socket, "status")
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        for proc in procs:
            proc.join(RUN_TIMEOUT_S)
        failed = [o["error"] for o in outs if "error" in o]
        if failed:
            raise RuntimeError(f"producer failed: {failed[0]}\n{daemon.log_tail()}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        code = daemon.stop()
        tail = daemon.log_tail(5)
        daemon.remove()
    if code != 0:
        raise RuntimeError(f"quiverd exited with {code}:\n{tail}")
    start, end = min(o["t0"] for o in outs), max(o["t1"] for o in outs)
    seconds = end - start
    payload = sum(o["bundles"] for o in outs) * len(ipcs[0])
    finalized = sum(a["segments_finalized"] - b["segments_finalized"]
                    for a, b in zip(st1["shards"], st0["shards"], strict=True))
    return {"mode": mode, "timed_window": [start, end], "seconds": seconds,
            "other_cpu_cores": others,
            "producer_cpu_cores": sum(o["cpu_s"] for o in outs) / seconds, "payload_bytes": payload,
            "mb_s": payload / seconds / 1e6, "segments_finalized": finalized,
            "daemon_cpu_cores": cpu.total_s / seconds,
            "daemon_cpu_us_per_bundle": cpu.total_s / max(payload // len(ipcs[0]), 1) * 1e6,
            "daemon_loop_cpu_cores": cpu.main_s / seconds}


def _start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = os.environ.get("PY_SPY_FLAGS", "").split()  # e.g. "--idle", "--native"
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--rate", "250", "--threads",
         "--format", "raw", "--output", str(out), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# ---- report ---------------------------------------------------------------------------
def markdown(fin: list[dict[str, Any]], read: list[dict[str, Any]],
             e2e: list[dict[str, Any]]) -> str:
    """The README tables: one per part that ran."""
    out: list[str] = []
    if fin:
        out += ["| finalize, 32 MiB of 256 KiB bundles | quiverd MB/s | encode + write ms "
                "| new_file + fsync MB/s | new_file, no fsync MB/s "
                "| vs fsync (target ≥ 0.8×) | vs no fsync |",
                "|---|" + "---:|" * 6, *map(_fin_md, fin), ""]
    if read:
        out += ["| read, same files | SegmentReader bundles/s | SegmentReader MB/s "
                "| read_all MB/s | get_batch loop bundles/s | vs read_all "
                "| vs get_batch loop |", "|---|" + "---:|" * 6, *map(_read_md, read), ""]
    if e2e:
        out += ["| ingest, 2 shards, 4 producers, interval | segments on MB/s "
                "(min–max) | segments off MB/s (min–max) | on / off (target ≥ 0.8×) "
                "| segments finalized while timed | daemon CPU cores on / off "
                "| daemon CPU µs per bundle on / off "
                "| runs counted (on + off; undisturbed) |",
                "|---|" + "---:|" * 7, *map(_e2e_md, e2e)]
    return "\n".join(out).strip()


def _fin_md(r: dict[str, Any]) -> str:
    m, s = r["median_ms"]["quiverd"], r["mb_s"]
    return (f"| {r['case']} | {s['quiverd']:.0f} | {m['encode']:.1f} + {m['write']:.1f} "
            f"| {s['baseline_fsync']:.0f} | {s['baseline_nofsync']:.0f} "
            f"| {r['ratio_fsync']:.2f}× | {r['ratio_nofsync']:.2f}× |")


def _read_md(r: dict[str, Any]) -> str:
    b, s = r["bundles_s"], r["mb_s"]
    return (f"| {r['case']} | {b['quiverd']:.0f} | {s['quiverd']:.0f} "
            f"| {s['baseline_read_all']:.0f} | {b['baseline_get_batch']:.0f} "
            f"| {r['ratio_read_all']:.2f}× | {r['ratio_get_batch']:.2f}× |")


def _e2e_md(r: dict[str, Any]) -> str:
    on, off = _counted(r["runs"]["on"]), _counted(r["runs"]["off"])
    cpu_on = statistics.median(x["daemon_cpu_cores"] for x in on)
    cpu_off = statistics.median(x["daemon_cpu_cores"] for x in off)
    segs = statistics.median(x["segments_finalized"] for x in on)
    us_on = statistics.median(x["daemon_cpu_us_per_bundle"] for x in on)
    us_off = statistics.median(x["daemon_cpu_us_per_bundle"] for x in off)
    every = r["runs"]["on"] + r["runs"]["off"]
    return (f"| {r['payload']} | {r['on_mb_s']:.0f} ({_spread(on)}) "
            f"| {r['off_mb_s']:.0f} ({_spread(off)}) | {r['ratio']:.2f}× | {segs:.0f} "
            f"| {cpu_on:.2f} / {cpu_off:.2f} | {us_on:.0f} / {us_off:.0f} "
            f"| {len(on)} + {len(off)} of {len(every)} |")


def _spread(runs: list[dict[str, Any]]) -> str:
    return f"{min(x['mb_s'] for x in runs):.0f}–{max(x['mb_s'] for x in runs):.0f}"


if __name__ == "__main__":
    sys.exit(main())
