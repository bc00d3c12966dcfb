"""Undecided exactly-once jobs (SPEC §7), through the running daemon's admin socket.

    quiverd jobs list [--json]              undecided jobs staged on this daemon: age,
                                            live writers, when each expires, the shards
                                            whose deliveries (and streams) wait for it
    quiverd jobs abort JOB_ID [--reason R]  record an abort in the catalog (as a driver's
                                            abort would): its staged rows are discarded on
                                            every daemon and the waiting streams move on

A job only a daemon knows of (staged, not decided) is listed by that daemon: with
several hosts, ask each one. An abort is a decision, recorded once in the shared catalog:
a later commit of the job is refused (JOB_CONFLICT), and a committed job cannot be
aborted.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quiverd.cli.output import table, utc

LIST_COLUMNS = ["job_id", "age_s", "bundles", "bytes", "writers", "idle_s", "expires_in_s",
                "holding_shards", "first_staged"]


def add_parsers(sub: Any, admin_args: Callable[[argparse.ArgumentParser], None],
                admin_socket: Callable[[argparse.Namespace], Path]) -> None:
    jobs = sub.add_parser("jobs", help="list and abort undecided exactly-once (Spark) jobs"
                          ).add_subparsers(metavar="CMD", required=True)
    s = jobs.add_parser("list", help="undecided jobs staged on the running daemon, oldest "
                        "first, with the shards whose delivery they hold")
    admin_args(s)
    s.set_defaults(func=lambda args: jobs_list(args, admin_socket(args)))
    s = jobs.add_parser("abort", help="abort an undecided job: its staged rows are discarded "
                        "and the deliveries waiting for it go on")
    s.add_argument("job_id", help="a job id from `quiverd jobs list`")
    s.add_argument("--reason", default="", help="recorded with the decision")
    admin_args(s)
    s.set_defaults(func=lambda args: jobs_abort(args, admin_socket(args)))


def jobs_list(args: argparse.Namespace, socket: Path) -> int:
    from quiverd.net.admin import request

    rows: list[dict[str, Any]] = request(socket, "jobs.list")
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    shown = [{**r, "first_staged": utc(r["first_staged_ns"]) if r["first_staged_ns"] else "",
              "writers": r["writers"],
              "idle_s": "-" if r["idle_s"] is None else r["idle_s"],
              "expires_in_s": "live" if r["expires_in_s"] is None else r["expires_in_s"],
              "holding_shards": ",".join(map(str, r["holding_shards"])) or "-"} for r in rows]
    table(LIST_COLUMNS, shown)
    if not rows:
        print("(no undecided jobs)")
    return 0


def jobs_abort(args: argparse.Namespace, socket: Path) -> int:
    from quiverd.net.admin import request

    result = request(socket, "jobs.abort", {"job_id": args.job_id, "reason": args.reason})
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    word = "was already" if result["already"] else "is now"
    print(f"job {result['job_id']} {word} {result['state']} ({result['reason']})")
    return 0
