"""Replay one seed: ``PYTHONHASHSEED=0 .venv/bin/python -m tests.sim.detsim SEED``.

Options: ``--plant NAME`` (a planted bug), ``--no-faults``, ``--harsh``,
``--janitor-grace-s S``, ``--janitor-interval-s S``,
``--bundles N``, ``--trace N`` (print the last N steps even on success), ``--json``
(one line of counts, for the test that runs many seeds in one process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tests.sim.detsim import PLANTS, SimFailed, Size, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.detsim")
    parser.add_argument("seeds", type=int, nargs="+")
    parser.add_argument("--plant", choices=[p for p in PLANTS if p], default="")
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--bundles", type=int, default=Size().bundles)
    parser.add_argument("--harsh", action="store_true",
                        help="3x the fault rates, 6 kills per run")
    parser.add_argument("--janitor-grace-s", type=int, default=Size().janitor_grace_s)
    parser.add_argument("--janitor-interval-s", type=int, default=Size().janitor_interval_s)
    parser.add_argument("--trace", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0":
        print("note: PYTHONHASHSEED is not 0: the trace may differ from the test's run",
              file=sys.stderr)
    failed = 0
    for seed in args.seeds:
        try:
            size = Size(bundles=args.bundles, kills=6 if args.harsh else Size().kills,
                        fault_scale=3.0 if args.harsh else 1.0,
                        janitor_grace_s=args.janitor_grace_s,
                        janitor_interval_s=args.janitor_interval_s)
            result = run(seed, size=size, faults=not args.no_faults, plant=args.plant)
        except SimFailed as exc:
            failed += 1
            result = exc.result
            if not args.json:
                print(exc)
        line = {"seed": seed, "ok": not result.error, "error": result.error,
                "steps": result.steps, "virtual_s": result.virtual_s, "wall_s": result.wall_s,
                "checks": result.checks, "commits": result.commits,
                "bundles_acked": result.bundles_acked, "rows": result.rows,
                "settled_after_s": result.settled_after_s,
                "kills": result.kills, "incarnations": result.incarnations,
                "faults": result.faults, "restarts": result.restarts,
                "events": result.events, "digest": result.digest(),
                "tail": result.tail() if result.error else ""}
        if args.json:
            print(json.dumps(line), flush=True)
        else:
            print({k: v for k, v in line.items() if k != "tail"})
            if args.trace:
                print(result.tail(args.trace))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
