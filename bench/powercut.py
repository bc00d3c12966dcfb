"""Power-cut campaign: hundreds of cuts, quiverd against a plain fdatasync writer.

    python bench/powercut.py --cycles 100                  # mix per cycle: see --mix
    python bench/powercut.py --cycles 400 --until 22:50    # stop starting rounds at 22:50 UTC

Each cycle runs the modes of ``--mix`` interleaved (default: 3 quiverd-gc-lake, 1
quiverd-plain, 3 plain-writer, 1 never), each round on a fresh loop-mounted xfs image
cut like ``xfs_io -x -c shutdown`` (tests/daemon/power_cut_rounds.py has the round).
Every round is printed and appended to ``<keep>/rounds.jsonl``; a lossy round keeps its
evidence under ``<keep>/<mode><n>/``. At the end a table of rounds, lossy rounds and
records lost per mode. Exit 1 if quiverd lost in a larger share of rounds than the
plain writer, 2 if the ``never`` negative control lost nothing (the harness is blind),
3 if a round broke the harness (the daemon did not stop the documented way...).
Needs root and xfsprogs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import DaemonProcess  # noqa: E402
from tests.daemon.power_cut_rounds import (  # noqa: E402
    MODES,
    RUN_S,
    Round,
    quiverd_round,
    writer_round,
)

QUIVERD = ("quiverd-plain", "quiverd-gc-lake")


def main() -> int:
    args = parse_args()
    # Run under nohup in the background, SIGINT is ignored: SIGTERM stops the campaign
    # the same way Ctrl-C does (the round's daemon is killed, its image unmounted).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    keep = Path(args.keep)
    keep.mkdir(parents=True, exist_ok=True)
    mix = parse_mix(args.mix)
    deadline = until(args.until)
    rng = random.Random(args.seed)
    rows: dict[str, list[Round]] = defaultdict(list)
    broken: list[str] = []
    print(f"power-cut campaign: {args.cycles} cycles of {mix}, cut "
          f"{'with' if args.flush_log else 'without'} log flush, evidence in {keep}", flush=True)
    try:
        run(args, mix, deadline, rng, keep, rows, broken)
    except KeyboardInterrupt:
        print("stopped (SIGINT/SIGTERM): the table covers the rounds finished", flush=True)
    return report(rows, broken)


def run(args: argparse.Namespace, mix: dict[str, int], deadline: float | None,
        rng: random.Random, keep: Path, rows: dict[str, list[Round]],
        broken: list[str]) -> None:
    n = 0
    with open(keep / "rounds.jsonl", "a") as journal:
        for cycle in range(args.cycles):
            if deadline is not None and time.time() > deadline:
                print(f"deadline reached after {cycle} cycles", flush=True)
                break
            order = [m for m, k in mix.items() for _ in range(k)]
            rng.shuffle(order)  # interleaved, in a different order each cycle
            for mode in order:
                n += 1
                t0 = time.monotonic()
                r = one(mode, n, rng, keep, args.flush_log, broken)
                if r is None:
                    continue
                rows[mode].append(r)
                line = {"mode": mode, "n": n, "cycle": cycle, "acked": r.acked,
                        "lost": len(r.lost), "acked_in_cut": r.acked_in_cut,
                        "lost_in_cut": len(r.lost_in_cut), "cut_ms": r.cut_ms,
                        "events": r.events, "problems": r.problems,
                        "evidence": str(r.evidence or "")}
                journal.write(json.dumps(line) + "\n")
                journal.flush()
                print(f"{mode:16} #{n:<5} acked {r.acked:6} lost {len(r.lost):4}"
                      f" | in cut {r.acked_in_cut:3} lost {len(r.lost_in_cut):3}"
                      f" | deleted {r.events.get('segments_deleted', '-')!s:>3}"
                      f" {'PROBLEM ' if r.problems else ''}{r.evidence or ''}"
                      f" ({time.monotonic() - t0:.1f} s)", flush=True)


def one(mode: str, n: int, rng: random.Random, keep: Path, flush_log: bool,
        broken: list[str]) -> Round | None:
    """One round in a fresh short directory (socket paths are limited to 107 bytes)."""
    work = Path(tempfile.mkdtemp(prefix="qpc", dir="/tmp"))
    run_s = rng.uniform(*RUN_S[mode])
    try:
        if mode == "plain-writer":
            return writer_round(work, n, run_s, keep, flush_log)
        return quiverd_round(lambda s, name: make(work, s, name), work, mode, n, run_s, keep,
                             flush_log)
    except (AssertionError, OSError, RuntimeError, TimeoutError) as e:
        broken.append(f"{mode} #{n}: {type(e).__name__}: {str(e)[-2000:]}")
        print(f"{mode:16} #{n:<5} BROKE THE HARNESS:\n{traceback.format_exc()[-3000:]}",
              flush=True)
        where = keep / f"{mode}{n}-broken"
        shutil.copytree(work, where, ignore=shutil.ignore_patterns("*.img"),
                        dirs_exist_ok=True)
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def make(work: Path, settings: dict[str, Any], name: str) -> DaemonProcess:
    root = work / name
    root.mkdir()
    return DaemonProcess(root, settings, {})


def report(rows: dict[str, list[Round]], broken: list[str]) -> int:
    """The table; lossy = lost a record acked before the cut began. The "in cut" columns
    are acks stamped while the shutdown ioctl ran, which a real power cut never returns."""
    print(f"\n{'mode':16} {'rounds':>6} {'w/ deletions':>12} {'lossy':>5} {'loss rate':>9} "
          f"{'acked':>8} {'lost':>5} | {'in cut: rounds':>14} {'acked':>6} {'lost':>5}"
          f" | {'problems':>8}")
    rate: dict[str, float] = {}
    for mode in MODES:
        rs = rows.get(mode, [])
        lossy = [r for r in rs if r.lost]
        rate[mode] = len(lossy) / len(rs) if rs else 0.0
        deleted = sum(r.deleted for r in rs) if mode == "quiverd-gc-lake" else "-"
        print(f"{mode:16} {len(rs):6} {deleted!s:>12} {len(lossy):5} {rate[mode]:9.2%} "
              f"{sum(r.acked for r in rs):8} {sum(len(r.lost) for r in rs):5} | "
              f"{sum(bool(r.lost_in_cut) for r in rs):14} {sum(r.acked_in_cut for r in rs):6}"
              f" {sum(len(r.lost_in_cut) for r in rs):5} | {sum(bool(r.problems) for r in rs):8}")
    for r in (r for rs in rows.values() for r in rs if r.problems):
        print(f"problem in {r.mode} #{r.n}: {r.problems[0][:300]}")
    for b in broken:
        print(f"broken round: {b.splitlines()[0]}")
    quiverd = [r for m in QUIVERD for r in rows.get(m, [])]
    q_rate = sum(bool(r.lost) for r in quiverd) / len(quiverd) if quiverd else 0.0
    if q_rate > rate["plain-writer"]:
        print(f"FAIL: quiverd lost in {q_rate:.2%} of rounds, the plain writer in "
              f"{rate['plain-writer']:.2%}")
        return 1
    if rows.get("never") and not any(r.lost for r in rows["never"]):
        print("FAIL: the never-policy negative control lost nothing: the harness is blind")
        return 2
    return 3 if broken else 0


def parse_mix(text: str) -> dict[str, int]:
    mix = {m: int(k) for m, k in (part.split("=") for part in text.split(","))}
    unknown = set(mix) - set(MODES)
    if unknown:
        raise SystemExit(f"powercut: unknown mode(s) {sorted(unknown)} hint: use {MODES}")
    return mix


def until(hhmm: str | None) -> float | None:
    """``HH:MM`` UTC today as a Unix time: no round starts after it."""
    if not hhmm:
        return None
    h, m = map(int, hhmm.split(":"))
    now = dt.datetime.now(dt.UTC)
    return now.replace(hour=h, minute=m, second=0, microsecond=0).timestamp()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--mix", default="quiverd-gc-lake=3,quiverd-plain=1,plain-writer=3,never=1")
    p.add_argument("--until", help="HH:MM UTC: start no round after it")
    p.add_argument("--keep", default="/tmp/powercut-evidence",
                   help="where rounds.jsonl and the evidence of lossy rounds go")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--flush-log", action="store_true",
                   help="cut like 'xfs_io shutdown -f' (the xfs log is flushed first)")
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(main())
