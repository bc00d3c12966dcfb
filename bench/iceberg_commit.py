"""Iceberg projection commit latency as table history grows, with expiry on (issue 20).

    python bench/iceberg_commit.py [--commits 1000] [--files-per-commit 2]
                                   [--replace-every 50] [--expire-every 10] [--keep-s 30]
                                   [--root DIR] [--json out.json]

One ``Projection`` on the embedded SQLite catalog (a WAL-mode ``catalog.sqlite``, as
quiverd's catalog opens it) and the fs store. Each round commits ``--files-per-commit``
small lake-style Parquet files (1,000 rows, one hour of 24 each) as one snapshot; every
``--replace-every`` rounds a compaction-like commit removes two live files and adds one
(an overwrite snapshot); every ``--expire-every`` rounds snapshots older than
``--keep-s`` are expired (the daemon's keep_snapshots_s is 600: a shorter bound here
makes expiry run within the bench). Files are written before the clock starts; a commit
is timed from the call to its return (footer reads, schema check, manifest writes,
metadata.json, the catalog's compare-and-swap). Printed: p50/p99/max of commits over the
whole run and over the last 10 % (after ~90 % of the history), expiry times, snapshots and
manifests kept, and the metadata directory's size.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from ulid import ULID  # noqa: E402

from bench._common import git_head  # noqa: E402
from quiverd.kernel.config import CatalogConfig, IcebergConfig, StoreConfig  # noqa: E402
from quiverd.lake.iceberg import (  # noqa: E402
    DataFileRef,
    Projection,
    catalog_uri,
    location,
    warehouse,
)

TIME = "_quiver_ingested_at"
ROWS = 1_000
HOURS = 24
START = datetime(2026, 11, 26, tzinfo=UTC)
TABLE = "quiver.web"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--commits", type=int, default=1000)
    ap.add_argument("--files-per-commit", type=int, default=2)
    ap.add_argument("--replace-every", type=int, default=50)
    ap.add_argument("--expire-every", type=int, default=10)
    ap.add_argument("--keep-s", type=float, default=30.0)
    ap.add_argument("--root", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="qv-iceberg-", dir=args.root))
    try:
        out = run(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


def run(root: Path, args: argparse.Namespace) -> dict[str, object]:
    data_dir = root / "data"
    data_dir.mkdir()
    with sqlite3.connect(data_dir / "catalog.sqlite") as db:  # as quiverd's catalog has it
        db.execute("PRAGMA journal_mode=wal")
    where, io_properties = warehouse(StoreConfig(), data_dir)
    total = args.commits * args.files_per_commit
    print(f"writing {total} files of {ROWS} rows ...", file=sys.stderr)
    refs = [write_file(data_dir / "objects", where, i) for i in range(total)]
    cfg = IcebergConfig(keep_snapshots_s=args.keep_s)
    projection = Projection(catalog_uri=catalog_uri(CatalogConfig(), data_dir),
                            warehouse=where, io_properties=io_properties, cfg=cfg)
    commits: list[float] = []
    replaces: list[float] = []
    expiries: list[float] = []
    expired = 0
    extra = 0
    try:
        for n in range(args.commits):
            batch = refs[n * args.files_per_commit:(n + 1) * args.files_per_commit]
            t0 = time.perf_counter()
            result = projection.commit(TABLE, batch, summary={"quiverd.round": str(n)})
            commits.append(time.perf_counter() - t0)
            assert not result.skipped, result.skipped
            if args.replace_every and (n + 1) % args.replace_every == 0:
                live = sorted(projection.live_locations(TABLE))[:2]
                merged = write_file(data_dir / "objects", where, total + extra)
                extra += 1
                t0 = time.perf_counter()
                projection.commit(TABLE, [merged], live)
                replaces.append(time.perf_counter() - t0)
            if args.expire_every and (n + 1) % args.expire_every == 0:
                t0 = time.perf_counter()
                expired += projection.expire(TABLE, older_than_s=args.keep_s)
                expiries.append(time.perf_counter() - t0)
            if (n + 1) % 100 == 0:
                print(f"  {n + 1} commits, last p50 {pct(commits[-100:], 50) * 1e3:.1f} ms",
                      file=sys.stderr)
        tbl = projection._catalog.load_table(("quiver", "web"))
        snap = tbl.metadata.current_snapshot()
        manifests = len(snap.manifests(tbl.io)) if snap is not None else 0
        live_files = len(projection.live_locations(TABLE))
        # Reads every kept snapshot's manifests: fails if expiry deleted one still in use.
        referenced_files = len(projection.referenced_locations(TABLE))
        rows = tbl.scan(selected_fields=("id",)).to_arrow().num_rows
    finally:
        projection.close()
    meta_dir = data_dir / "objects" / "_iceberg" / "quiver" / "web" / "metadata"
    tail = commits[-max(1, len(commits) // 10):]
    return {
        "git": git_head(), "commits": args.commits, "files_per_commit": args.files_per_commit,
        "replace_every": args.replace_every, "expire_every": args.expire_every,
        "keep_s": args.keep_s, "catalog": "sqlite", "store": "fs",
        "commit_ms": summary_ms(commits), "commit_last10pct_ms": summary_ms(tail),
        "replace_ms": summary_ms(replaces), "expire_ms": summary_ms(expiries),
        "snapshots_expired": expired, "snapshots_kept": len(tbl.metadata.snapshots),
        "manifests_in_current": manifests, "live_files": live_files,
        "referenced_files": referenced_files, "rows_scanned": rows,
        "metadata_files": sum(1 for _ in meta_dir.iterdir()),
        "metadata_bytes": sum(p.stat().st_size for p in meta_dir.iterdir()),
    }


def write_file(objects: Path, where: str, i: int) -> DataFileRef:
    """A lake-style file of ROWS rows inside hour ``i % HOURS`` of START."""
    hour = START + timedelta(hours=i % HOURS)
    table = pa.table({
        "id": pa.array(range(i * ROWS, (i + 1) * ROWS), pa.int64()),
        "msg": pa.array([f"message {j}" for j in range(ROWS)]),
        TIME: pa.array([hour + timedelta(milliseconds=j) for j in range(ROWS)],
                       pa.timestamp("us", tz="UTC")),
        "_quiver_shard": pa.array([0] * ROWS, pa.int32()),
        "_quiver_segment": pa.array([i] * ROWS, pa.int64()),
        "_quiver_bundle": pa.array(range(ROWS), pa.int64()),
    })
    file_id = str(ULID())
    key = f"client=web/slot=0/date={hour:%Y-%m-%d}/hour={hour:%H}/bench_{file_id}.parquet"
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    path = objects / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(sink.getvalue())
    return DataFileRef(file_id=file_id, location=location(where, key), client="web", slot=0,
                       partition_column=TIME)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] if ordered else 0.0


def summary_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"n": len(values), "p50": round(pct(values, 50) * 1e3, 1),
            "p99": round(pct(values, 99) * 1e3, 1), "max": round(max(values) * 1e3, 1),
            "mean": round(statistics.fmean(values) * 1e3, 1)}


if __name__ == "__main__":
    main()
