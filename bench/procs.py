"""Process per shard, measured: one 2-shard quiverd against two 1-shard quivers side by side.

    python bench/procs.py [--quick] [--repeat 3] [--producers 4] [--size-kib 64]

Issue 18 asks whether one process per shard (shards stop sharing one GIL) still looks
needed after the hot path was rebuilt. Same producers, bundles and volume as
bench/ingest.py's interval scenario (segments off), run two ways, alternating order:

    one     one daemon, 2 shards, every producer connected to it
    two     two daemons, 1 shard each, producers split between them

Prints acked bundles/s (sum over daemons), daemon CPU µs per bundle (all daemon
processes), and the ratio two / one per round (median and spread). A ratio well above
1 means the shards' threads contend for one GIL; near 1, one process is enough.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Daemon, KiB, client_names, make_table, process_cpu_s  # noqa: E402
from ingest import (  # noqa: E402
    RUN_TIMEOUT_S,
    SEGMENTS_OFF,
    VOLUME,
    WARMUP_FRACTION,
    Scenario,
    _producer,
)


def run(daemons: int, scn: Scenario, ipc: bytes, root: Path) -> tuple[float, float]:
    """(acked bundles/s, daemon CPU µs per bundle) with ``daemons`` daemons of
    2 / daemons shards each, producers assigned round robin."""
    ds = [Daemon(root, policy="interval", shards=2 // daemons, settings=SEGMENTS_OFF,
                 tag=f"d{i}") for i in range(daemons)]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(scn.producers + 1)
    results: Any = ctx.Queue()
    names = client_names(scn.producers, 2, scn.name)
    procs = [ctx.Process(target=_producer, args=(str(ds[i % daemons].socket), name, ipc, scn,
                                                 barrier, results))
             for i, name in enumerate(names)]
    try:
        for proc in procs:
            proc.start()
        try:
            barrier.wait(RUN_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"a producer failed: {results.get(timeout=10)}") from None
        cpu0 = sum(process_cpu_s(d.pid) for d in ds)
        outs = [results.get(timeout=RUN_TIMEOUT_S) for _ in procs]
        cpu = sum(process_cpu_s(d.pid) for d in ds) - cpu0
        for proc in procs:
            proc.join(RUN_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        codes = [d.stop() for d in ds]
        for d in ds:
            d.remove()
    if any(codes) or any("error" in o for o in outs):
        raise RuntimeError(f"daemon exit codes {codes}; producer errors "
                           f"{[o.get('error') for o in outs]}")
    seconds = max(o["t1"] for o in outs) - min(o["t0"] for o in outs)
    bundles = sum(o["bundles"] for o in outs)
    return bundles / seconds, cpu / bundles * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1/8 of the volume per run")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--size-kib", type=int, default=64)
    p.add_argument("--dir", default=tempfile.gettempdir())
    args = p.parse_args(argv)
    size = args.size_kib * KiB
    table, ipc = make_table(size)
    total = VOLUME.get(size, 128 * 1024 * KiB) // (8 if args.quick else 1) // size
    scn = Scenario(producers=args.producers, bundle_bytes=size, policy="interval",
                   bundles_per_producer=max(total // args.producers, 1),
                   warmup_per_producer=max(total // WARMUP_FRACTION // args.producers, 2))
    root = Path(args.dir)
    print(f"# process per shard: {args.producers} producers, {args.size_kib} KiB, "
          f"{os.cpu_count()} cores, {args.repeat} rounds")
    rows = []
    for rep in range(args.repeat):
        order = (1, 2) if rep % 2 == 0 else (2, 1)
        got = {n: run(n, scn, ipc, root) for n in order}
        rows.append(got)
        print(f"round {rep}: one {got[1][0]:.0f} b/s {got[1][1]:.0f} µs/bundle | two "
              f"{got[2][0]:.0f} b/s {got[2][1]:.0f} µs/bundle | two / one "
              f"{got[2][0] / got[1][0]:.2f}", flush=True)
        time.sleep(1)
    ratios = [r[2][0] / r[1][0] for r in rows]
    print(f"two 1-shard daemons / one 2-shard daemon, bundles/s: median "
          f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}); CPU µs per "
          f"bundle one {statistics.median(r[1][1] for r in rows):.0f}, two "
          f"{statistics.median(r[2][1] for r in rows):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
