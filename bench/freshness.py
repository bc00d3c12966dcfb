"""Seconds-fresh (issue 29): from a plain producer's bundle to the Iceberg snapshot that
first holds it, with the default config, and the lake's file sizes after compaction.

    python bench/freshness.py [--rates 1 20 100] [--seconds S] [--clients N]
                              [--json out.json] [--set key=value ...]

Per rate (MB/s of Arrow IPC, 1 MB = 10^6 bytes): a fresh daemon with the default config
(only its data directory, log format and ``--set`` keys given); ``--clients`` producer
processes (1), each its own client (so its own Iceberg table), send the logs-like 1 MiB
bundles of bench/lake.py, paced to the rate in all, for ``--seconds``. While it
runs, a watcher reads every file the catalog registers (its four ``_quiver_`` columns,
from the local store) before compaction can replace it. After the last ACK: until the
lake's freshness is 0 (every acked bundle in a committed snapshot). Then per bundle:

    freshness = timestamp-ms of the first snapshot naming a file that holds the bundle
                (the summary's ``quiverd.file-ids``; a file compaction replaced before
                the projection committed it: its output's) - the bundle's
                ``_quiver_ingested_at``

The ingestion time is taken before the WAL's fdatasync and the ACK, so this is an upper
bound on ACK -> snapshot (by the ack's own latency, a few ms). p50 / p99 / max over
bundles; target p99 <= 5 s. Then one compaction pass (``quiverd compact``, what the
default ``lake.compaction.interval_s`` runs in the background) and the median size of
the live (registered) files, and the snapshots each table keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_head, percentile  # noqa: E402
from lake import BUNDLE_BYTES, POOL, SEED, LakeDaemon, Pool, _produce, _remove  # noqa: E402

from quiverd.kernel import logs  # noqa: E402
from quiverd.kernel.config import CatalogConfig  # noqa: E402
from quiverd.kernel.logs import get as get_logger  # noqa: E402
from quiverd.lake.catalog import open_catalog  # noqa: E402
from quiverd.lake.model import REGISTERED, FileRow, FileState  # noqa: E402

TARGET_P99_S = 5.0
MEDIAN_TARGET_BYTES = 32 << 20
WATCH_S = 0.5
DRAIN_TIMEOUT_S = 300.0
Bundle = tuple[int, int, int]
WATCHED = frozenset(REGISTERED) | {FileState.COMPACTED}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 20.0, 100.0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key by dotted name (value as JSON, else a string)")
    p.add_argument("--no-compact", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep each run's directory")
    p.add_argument("--dir", default=os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    settings: dict[str, Any] = {"log.level": "info"}
    for item in args.set:
        key, _, raw = item.partition("=")
        try:
            settings[key] = json.loads(raw)
        except ValueError:
            settings[key] = raw
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    pool = Pool.make(POOL, BUNDLE_BYTES, SEED)
    meta = {"commit": git_head(), "cores": os.cpu_count(), "python": platform.python_version(),
            "pyarrow": pa.__version__, "seconds": args.seconds, "settings": settings}
    print(f"# quiverd freshness bench at {meta['commit'] or '?'}: {os.cpu_count()} cores, "
          f"{args.seconds:.0f} s per rate, config defaults + {settings}", flush=True)
    out: dict[str, Any] = {"meta": meta, "runs": []}
    for rate in args.rates:
        run = one_rate(pool, rate, args.seconds, root, settings, compact=not args.no_compact,
                       keep=args.keep, clients=args.clients)
        out["runs"].append(run)
        print(line(run), flush=True)
    print()
    print(report(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


class Watcher(threading.Thread):
    """Reads each newly registered file's bundle ids and ingestion times once."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(daemon=True)
        self.data_dir = data_dir
        self.bundles: dict[str, dict[Bundle, int]] = {}  # file_id -> bundle -> ingested us
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_flag.is_set():
                self.scan()
                self.stop_flag.wait(WATCH_S)
            self.scan()
        except BaseException as e:  # reported by the caller
            self.error = e

    def scan(self) -> None:
        db = self.data_dir / "catalog.sqlite"
        if not db.exists():
            return
        rows = anyio.run(_rows, db)
        for r in rows:
            # A compaction input too: one registered and replaced between two scans
            # (its object stays for lake.compaction.delete_grace_s).
            if r.file_id in self.bundles or r.state not in WATCHED:
                continue
            self.bundles[r.file_id] = bundle_ids(self.data_dir / "objects" / r.object_key)


def bundle_ids(path: Path) -> dict[Bundle, int]:
    """The bundles of one lake file, each with its ingestion time (µs)."""
    t = pq.read_table(path, columns=["_quiver_shard", "_quiver_segment", "_quiver_bundle",
                                     "_quiver_ingested_at"])
    ids: dict[Bundle, int] = {}
    for s, g, b, at in zip(t["_quiver_shard"].to_pylist(), t["_quiver_segment"].to_pylist(),
                           t["_quiver_bundle"].to_pylist(),
                           t["_quiver_ingested_at"].cast(pa.int64()).to_pylist(), strict=True):
        ids.setdefault((s, g, b), at)
    return ids


async def _rows(db: Path) -> list[FileRow]:
    logs.configure("console", "warning")
    async with open_catalog(CatalogConfig(), db, log=get_logger("bench")) as catalog:
        return await catalog.list_files()


def first_snapshots(db: Path) -> tuple[dict[str, int], dict[str, int]]:
    """file_id -> timestamp-ms of the first snapshot naming it; table -> snapshots kept."""
    from pyiceberg.catalog.sql import SqlCatalog

    cat = SqlCatalog("quiverd", uri=f"sqlite:///{db}")
    added: dict[str, int] = {}
    kept: dict[str, int] = {}
    for ident in cat.list_tables("quiver"):
        snaps = cat.load_table(ident).snapshots()
        kept[".".join(ident)] = len(snaps)
        for snap in snaps:
            ids = (snap.summary.additional_properties.get("quiverd.file-ids", "")
                   if snap.summary is not None else "")
            for fid in filter(None, ids.split(",")):
                added[fid] = min(added.get(fid, snap.timestamp_ms), snap.timestamp_ms)
    return added, kept


def one_rate(pool: Pool, rate_mb_s: float, seconds: float, root: Path,
             settings: dict[str, Any], *, compact: bool, keep: bool, clients: int = 1
             ) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="qd-fresh-", dir=root))
    bundles_s = rate_mb_s * 1e6 / pool.mean_bytes
    each = max(round(bundles_s * seconds / clients), 1)
    plan = {c: pool.sequence(c, each) for c in range(clients)}
    sent = each * clients
    print(f"\n# {rate_mb_s:g} MB/s: {sent} bundles of {pool.mean_bytes / 1e6:.2f} MB "
          f"in {seconds:.0f} s from {clients} client(s)", flush=True)
    try:
        daemon = LakeDaemon(directory, tag="fresh", settings=settings)
        watcher = Watcher(daemon.data_dir)
        try:
            daemon.status()
            watcher.start()
            sent_s, _ = _produce(daemon, plan, bundles_s)
            fresh_max = 0.0
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while True:
                lake = daemon.status()["lake"]
                fresh_max = max(fresh_max, lake.get("freshness_s") or 0.0)
                if lake.get("freshness_s") == 0 and lake["iceberg"]["lag_files"] == 0:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"still not fresh after {DRAIN_TIMEOUT_S} s: {lake}")
                time.sleep(0.2)
            watcher.stop_flag.set()
            watcher.join(120)
            if watcher.error is not None:
                raise watcher.error
            db = daemon.data_dir / "catalog.sqlite"
            added_ms, kept = first_snapshots(db)
            # A file a compaction replaced before the projection committed it reaches the
            # tables in its output's snapshot: follow compacted_into to it.
            into = {r.file_id: r.compacted_into for r in anyio.run(_rows, db)}
            lags: dict[Bundle, float] = {}
            for fid, ids in watcher.bundles.items():
                seen_ms, at = added_ms.get(fid), fid
                while seen_ms is None and into.get(at):
                    at = into[at]
                    seen_ms = added_ms.get(at)
                if seen_ms is None:
                    raise AssertionError(f"registered file {fid} is in no snapshot")
                for bundle, at_us in ids.items():
                    lag = seen_ms / 1e3 - at_us / 1e6
                    lags[bundle] = min(lags.get(bundle, lag), lag)
            if len(lags) != sent:
                raise AssertionError(f"{len(lags)} bundles seen in lake files, {sent} sent")
            live = [r for r in anyio.run(_rows, db) if r.state in REGISTERED]
            held = {b for r in live for b in bundle_ids(daemon.data_dir / "objects" /
                                                        r.object_key)}
            if len(held) != sent:  # the lake's own answer: every acked bundle, once
                raise AssertionError(f"{len(held)} bundles in live lake files, {sent} sent")
            before = _live(db)
            compacted = _compact(daemon) if compact else None
            after = _live(db)
            added_after, kept_after = first_snapshots(db)
        finally:
            watcher.stop_flag.set()
            daemon.stop_ok()
    finally:
        if keep:
            print(f"  kept {directory}", flush=True)
        else:
            _remove(directory, None)
    values = sorted(lags.values())
    return {"rate_mb_s": rate_mb_s, "clients": clients, "bundles": len(values), "send_s": sent_s,
            "p50_s": percentile(values, 50), "p99_s": percentile(values, 99),
            "max_s": values[-1], "status_freshness_max_s": fresh_max,
            "files_before": len(before), "median_before_bytes": _median(before),
            "compact": compacted, "files_after": len(after),
            "median_after_bytes": _median(after), "snapshots_kept": kept_after,
            "snapshots_at_drain": kept}


def _live(db: Path) -> list[int]:
    return [r.compressed_size for r in anyio.run(_rows, db) if r.state in REGISTERED
            and r.state != FileState.COMPACTED]


def _median(sizes: list[int]) -> float:
    return float(statistics.median(sizes)) if sizes else 0.0


def _compact(daemon: LakeDaemon) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "quiverd", "compact", "--config",
                           str(daemon.config_path)], capture_output=True, text=True,
                          timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"quiverd compact failed: {proc.stdout}{proc.stderr}")
    return {"s": time.perf_counter() - t0, "out": proc.stdout.strip()[-400:]}


def line(run: dict[str, Any]) -> str:
    ok = "met" if run["p99_s"] <= TARGET_P99_S else "NOT met"
    return (f"  {run['rate_mb_s']:g} MB/s, {run.get('clients', 1)} client(s), {run['bundles']} "
            f"bundles: bundle -> snapshot p50 "
            f"{run['p50_s']:.2f} s, p99 {run['p99_s']:.2f} s, max {run['max_s']:.2f} s "
            f"(p99 <= {TARGET_P99_S:g} s: {ok}); status freshness max "
            f"{run['status_freshness_max_s']:.2f} s; live files {run['files_before']} "
            f"(median {run['median_before_bytes'] / 2**20:.1f} MiB) -> after compaction "
            f"{run['files_after']} (median {run['median_after_bytes'] / 2**20:.1f} MiB); "
            f"snapshots kept {sum(run['snapshots_kept'].values())}")


def report(out: dict[str, Any]) -> str:
    return "\n".join(["## Freshness", *(line(r) for r in out["runs"])])


if __name__ == "__main__":
    raise SystemExit(main())
