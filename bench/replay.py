"""Restart with a large WAL: time from exec of ``quiverd serve`` to ready.

    python bench/replay.py [--gib 4] [--shards 2] [--bundle-kib 1024] [--warm] [--dir PATH]

1. A daemon with segments off (target size and open duration huge, the WAL big enough)
   takes ``--gib`` GiB of acknowledged bundles from one producer process per shard.
2. It is killed with SIGKILL: every bundle is acknowledged, none is in a segment, so
   the whole WAL must be replayed.
3. The page cache is dropped (``echo 3 > /proc/sys/vm/drop_caches``, needs root;
   ``--warm`` skips it), then ``quiverd serve`` starts on the same directory; the
   clock runs from the exec to ready (the admin socket answers).
4. Baseline, same run: reading the same WAL files cold with one ``read`` loop
   (the disk's sequential read speed), printed beside it as a ratio.

After ready it waits until the replayed bundles are finalized into segments (the
daemon takes new bundles meanwhile) and prints that time too, then stops the daemon.
Target (issue 11/12): ready in <= 10 s with 4 GiB of WAL.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Daemon, KiB, MiB, client_names, filesystem_of, git_head, make_table  # noqa: E402

from quiverd.client.producer import Client  # noqa: E402
from quiverd.net.admin import request as admin_request  # noqa: E402

GiB = 1 << 30
SEGMENTS_OFF = {"segment.target_size_bytes": 1 << 40, "segment.max_open_duration_ms": 3_600_000,
                "wal.max_size_bytes": 64 << 30, "wal.max_chunks": 256}
TARGET_S = 10.0


def _produce(socket: str, client: str, ipc_bytes: int, nbytes: int, out: mp.Queue) -> None:
    try:
        table, _ = make_table(ipc_bytes)
        sent = 0
        with Client.connect(socket) as c:
            while sent < nbytes:
                c.send_many([table] * 32, client=client)
                sent += 32 * ipc_bytes
        out.put(sent)
    except Exception as exc:  # reported by the parent
        out.put(repr(exc))


def _fill(d: Daemon, shards: int, ipc_bytes: int, total: int) -> int:
    out: mp.Queue = mp.Queue()
    names = client_names(shards, shards, "replay")
    procs = [mp.Process(target=_produce, args=(str(d.socket), n, ipc_bytes, total // shards, out))
             for n in names]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    bad = [r for r in results if not isinstance(r, int)]
    if bad:
        raise RuntimeError(f"producer failed: {bad[0]}\n{d.log_tail()}")
    return sum(results)


def _drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _wal_files(data_dir: Path) -> list[Path]:
    return sorted(p for p in data_dir.glob("shard-*/wal/quiver.wal*") if p.is_file())


def _read_baseline(files: list[Path]) -> float:
    """Seconds to read every WAL file once, sequentially, 8 MiB at a time."""
    started = time.perf_counter()
    buf = bytearray(8 * MiB)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - started


def _until_finalized(d: Daemon, timeout_s: float) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        status = admin_request(d.admin_socket, "status")
        if all(s.get("open_bundles", 0) == 0 and s.get("wal_bytes", 0) < 64 * MiB
               for s in status["shards"]):
            return time.perf_counter() - started
        time.sleep(0.1)
    return float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--bundle-kib", type=int, default=1024)
    p.add_argument("--warm", action="store_true", help="keep the page cache (no drop)")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = p.parse_args()
    fs = filesystem_of(args.dir)
    print(f"# quiverd replay bench: {args.gib:g} GiB WAL, {args.shards} shards, "
          f"{args.bundle_kib} KiB bundles, {os.cpu_count()} cores, data under {args.dir} ({fs}), "
          f"python {platform.python_version()}, commit {git_head()}", flush=True)
    d = Daemon(args.dir, policy="interval", shards=args.shards, settings=SEGMENTS_OFF)
    try:
        started = time.perf_counter()
        sent = _fill(d, args.shards, args.bundle_kib * KiB, int(args.gib * GiB))
        took = time.perf_counter() - started
        print(f"  filled: {sent / GiB:.2f} GiB acknowledged in {took:.1f} s", flush=True)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        d._log.close()
        files = _wal_files(d.data_dir)
        wal_bytes = sum(f.stat().st_size for f in files)
        cold = not args.warm and _drop_caches()
        read_s = _read_baseline(files)
        if not args.warm:
            _drop_caches()
        d2 = Daemon(args.dir, policy="interval", shards=args.shards, settings=SEGMENTS_OFF
                    | {"segment.target_size_bytes": 32 * MiB,
                       "segment.max_open_duration_ms": 1000},
                    directory=d.dir, tag="restart")
        ready_s = d2.ready - d2.spawned
        status = admin_request(d2.admin_socket, "status")
        entries = sum(s.get("replay", {}).get("entries", 0) for s in status["shards"])
        try:
            finalized_s = _until_finalized(d2, 600)
        except Exception:
            print(d2.log_tail(40), file=sys.stderr)
            raise
        code = d2.stop()
    finally:
        d.remove()
    cache = "cold" if cold else "warm"
    print("\n| WAL GiB | entries | cache | ready s | finalized after ready s | disk read s "
          "| ready / disk read | target |")
    print("|---:|---:|---|---:|---:|---:|---:|---|")
    print(f"| {wal_bytes / GiB:.2f} | {entries or '?'} | {cache} | {ready_s:.2f} | "
          f"{finalized_s:.1f} | {read_s:.2f} | {ready_s / read_s:.2f}x | "
          f"{'met' if ready_s <= TARGET_S else 'NOT met'} (<= {TARGET_S:g} s) |")
    if code != 0:
        print(f"daemon exited {code} on SIGTERM", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
