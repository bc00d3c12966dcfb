"""The Iceberg projection's cost and lag (issue 20's targets).

    python bench/iceberg.py [--quick] [--repeat N] [--json out.json] [--steady-s S]

throughput  bench/lake.py's uploader run (a backlog ingested with the lake off, then
            converted by the uploader; timed from "ready" to every bundle in a registered
            file), 2 clients, 8 MiB files (dozens per run, so the projection commits
            while the uploader works), ``--repeat`` pairs with the projection off and on,
            alternating which goes first. Target: on/off within 5 % (ratio >= 0.95).
lag         a daemon with the lake and the projection on; one producer at a steady rate
            for ``--steady-s`` seconds with 1 s files, so a rotation round registers files
            every second; then until the projection has nothing pending. Per file: the
            time from its upload (``uploaded_at``, before its registration: an upper bound
            on the lag after registration) to the commit of the snapshot that added it
            (the snapshot's ``timestamp-ms``, matched through the summary's
            ``quiverd.file-ids``). Target: p99 <= 5 s. Also ``status``'s ``lag_s`` once a
            second (its max) and the daemon's commit p99.

Commit latency after 1,000 snapshots with expiry on is bench/iceberg_commit.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_head, percentile  # noqa: E402
from lake import (  # noqa: E402
    BUNDLE_BYTES,
    LAKE_SETTINGS,
    POOL,
    SEED,
    VOLUME_BYTES,
    LakeDaemon,
    Pool,
    _produce,
    _remove,
    run_uploader,
)

from quiverd.kernel.config import CatalogConfig  # noqa: E402
from quiverd.kernel.logs import get as get_logger  # noqa: E402
from quiverd.lake.catalog import open_catalog  # noqa: E402
from quiverd.lake.model import REGISTERED, FileRow  # noqa: E402

CLIENTS = 2
FILE_BYTES = 8 << 20
STEADY_S = 30.0
STEADY_MB_S = 20.0  # well under the uploader's rate: a steady state, not a backlog
LAG_TARGET_S = 5.0
THROUGHPUT_FLOOR = 0.95


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="1/8 of the volume, 10 s steady")
    p.add_argument("--repeat", type=int, default=2, help="off/on pairs (default 2)")
    p.add_argument("--steady-s", type=float, default=None)
    p.add_argument("--mib", type=int, default=None, help="Arrow IPC per uploader run")
    p.add_argument("--only", nargs="+", default=["throughput", "lag"],
                   choices=["throughput", "lag"])
    p.add_argument("--dir", default=os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    volume = VOLUME_BYTES // 8 if args.quick else VOLUME_BYTES
    volume = args.mib << 20 if args.mib else volume
    steady_s = args.steady_s or (10.0 if args.quick else STEADY_S)
    pool = Pool.make(POOL, BUNDLE_BYTES, SEED)
    meta = {"commit": git_head(), "cores": os.cpu_count(), "python": platform.python_version(),
            "pyarrow": pa.__version__, "volume_bytes": volume, "repeat": args.repeat}
    print(f"# quiverd Iceberg projection bench at {meta['commit'] or '?'}: "
          f"{os.cpu_count()} cores, {volume >> 20} MiB per uploader run", flush=True)
    out: dict[str, Any] = {"meta": meta}
    if "throughput" in args.only:
        out["throughput"] = throughput(pool, volume, args.repeat, root)
    if "lag" in args.only:
        out["lag"] = steady_lag(pool, steady_s, root)
    print()
    print(report(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def throughput(pool: Pool, volume: int, repeat: int, root: Path) -> dict[str, Any]:
    per_client = max(volume // BUNDLE_BYTES // CLIENTS, 1)
    plan = {c: pool.sequence(c, per_client) for c in range(CLIENTS)}
    # Small files, so a run registers dozens and the projection commits during it.
    lake = {**LAKE_SETTINGS, "lake.file_duration_ms": 2000, "lake.file_size_bytes": FILE_BYTES}
    runs: dict[str, list[float]] = {"off": [], "on": []}
    for rep in range(repeat):
        order = ("off", "on") if rep % 2 == 0 else ("on", "off")
        for mode in order:
            settings = {**lake, "lake.iceberg.enabled": mode == "on"}
            up = run_uploader(pool, plan, root, settings, None, None)
            runs[mode].append(up["mb_s"])
            print(f"  run {rep} projection {mode:3}: {up['mb_s']:6.1f} MB/s of Arrow IPC "
                  f"({up['files']} files, busy {up['busy_s']:.1f} s)", flush=True)
    best = {m: max(v) for m, v in runs.items()}
    mean = {m: sum(v) / len(v) for m, v in runs.items()}
    return {"mb_s": runs, "ratio_best": best["on"] / best["off"],
            "ratio_mean": mean["on"] / mean["off"]}


def steady_lag(pool: Pool, seconds: float, root: Path) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="qd-ice-", dir=root))
    bundles_s = STEADY_MB_S * 1e6 / pool.mean_bytes
    plan = {0: pool.sequence(0, max(round(bundles_s * seconds), 1))}
    settings = {**LAKE_SETTINGS, "lake.file_duration_ms": 1000, "lake.enabled": True,
                "log.level": "info"}
    print(f"\n# lag: 1 producer at {STEADY_MB_S:.0f} MB/s for {seconds:.0f} s, 1 s files, "
          "projection on", flush=True)
    try:
        daemon = LakeDaemon(directory, tag="steady", settings=settings)
        try:
            _produce(daemon, plan, bundles_s)
            lag_samples = []
            deadline = time.monotonic() + 120
            while True:
                ice = daemon.status()["lake"]["iceberg"]
                lag_samples.append(ice["lag_s"])
                lake = daemon.status()["metrics"]["quiver_subscriber_lag"].get("uploader", {})
                if lake.get("lag_bundles") == 0 and ice["lag_files"] == 0:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"projection still lags: {ice}")
                time.sleep(0.5)
            final = daemon.status()["lake"]["iceberg"]
            per_file = anyio.run(_file_lags, daemon.data_dir)
        finally:
            daemon.stop_ok()
    finally:
        _remove(directory, None)
    lags = sorted(per_file.values())
    return {"files": len(lags), "p50_s": percentile(lags, 50), "p99_s": percentile(lags, 99),
            "max_s": lags[-1] if lags else None, "status_lag_max_s": max(lag_samples),
            "commits": final["commits"], "commit_p99_ms": final["commit_p99_ms"]}


async def _file_lags(data_dir: Path) -> dict[str, float]:
    """Seconds from each registered file's upload to the snapshot that added it."""
    from pyiceberg.catalog.sql import SqlCatalog

    db = data_dir / "catalog.sqlite"
    async with open_catalog(CatalogConfig(), db, log=get_logger("bench")) as catalog:
        rows: list[FileRow] = await catalog.list_files(states=REGISTERED)
    cat = SqlCatalog("quiverd", uri=f"sqlite:///{db}")
    added_ms: dict[str, int] = {}
    for ident in cat.list_tables("quiver"):
        for snap in cat.load_table(ident).snapshots():
            ids = (snap.summary.additional_properties.get("quiverd.file-ids", "")
                   if snap.summary is not None else "")
            for fid in filter(None, ids.split(",")):
                added_ms.setdefault(fid, snap.timestamp_ms)
    missing = [r.file_id for r in rows if r.file_id not in added_ms]
    if missing:
        raise AssertionError(f"{len(missing)} registered files in no snapshot: {missing[:3]}")
    return {r.file_id: max(0.0, added_ms[r.file_id] / 1e3 - r.uploaded_at / 1e9) for r in rows}


def report(out: dict[str, Any]) -> str:
    lines = ["## Iceberg projection"]
    t = out.get("throughput")
    if t:
        ok = "met" if t["ratio_best"] >= THROUGHPUT_FLOOR else "NOT met"
        lines.append(f"uploader throughput, projection on / off: {t['ratio_best']:.3f} best, "
                     f"{t['ratio_mean']:.3f} mean (target >= {THROUGHPUT_FLOOR}: {ok}); "
                     f"MB/s off {t['mb_s']['off']}, on {t['mb_s']['on']}")
    lag = out.get("lag")
    if lag:
        ok = "met" if lag["p99_s"] <= LAG_TARGET_S else "NOT met"
        lines.append(f"projection lag after upload, {lag['files']} files: p50 "
                     f"{lag['p50_s']:.2f} s, p99 {lag['p99_s']:.2f} s, max {lag['max_s']:.2f} s "
                     f"(target p99 <= {LAG_TARGET_S} s: {ok}); status lag_s max "
                     f"{lag['status_lag_max_s']:.2f} s; {lag['commits']} commits, commit p99 "
                     f"{lag['commit_p99_ms']} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
