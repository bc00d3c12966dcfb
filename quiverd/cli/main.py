"""The ``quiverd`` command line: daemon, producer tool and admin commands.

    quiverd serve --config PATH            run the daemon
    quiverd check-config PATH [--probe]    validate a config file (--probe: reach the lake)
    quiverd send --socket S --client C FILE...   send Arrow IPC / Parquet files
    quiverd status [--json]                daemon, per-shard counters (admin socket)
    quiverd wal dump PATH [--json]         every WAL entry, with CRC ok/bad
    quiverd segments list [--json]         finalized segments (admin socket)
    quiverd segment dump FILE [--json]     one segment's directory, manifest, schemas
    quiverd subscribers add NAME [--from earliest|latest]   register a subscriber
    quiverd subscribers remove NAME        unregister (releases its hold on segments)
    quiverd subscribers list [--json]      subscribers and their lag (admin socket)
    quiverd subscribe NAME (--out DIR | --count N)   console consumer (ingest socket)
    quiverd jobs list [--json]             undecided exactly-once jobs (admin socket)
    quiverd jobs abort JOB_ID              abort one: its waiting streams go on (cli/jobs.py)
    quiverd fsck DATA_DIR [--repair] [--lake]   verify WAL, sidecars, segments (+ lake)
    quiverd files list|show|restore|forget ...   lake files in the catalog (cli/lake.py)
    quiverd janitor [--dry-run]            reconcile objects and catalog rows
    quiverd compact [--client C]           merge small lake files

Errors print the message and a ``hint:`` line; the exit code is non-zero (2 for a
usage error, as argparse). A reader that stops early (``quiverd status | head -1``)
ends the command quietly with 141, the status of a tool killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from pathlib import Path
from typing import Any, NoReturn

from quiverd import __version__
from quiverd.cli.output import table, utc
from quiverd.kernel import config as config_mod
from quiverd.kernel.errors import ConfigError, QuiverError

DEFAULT_CONFIG = "/etc/quiverd/config.toml"
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE, what a shell reports for `cat` cut off by `head`


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader gone shows here, not as a warning at exit
        return code
    except QuiverError as exc:
        _print_error(exc)
        return 1
    except ConnectionError as exc:  # reset, broken pipe, closed mid-stream
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            return _stdout_gone()
        print(f"quiverd: the daemon closed the connection ({exc.strerror or exc})",
              file=sys.stderr)
        print("hint: check the daemon's log (journalctl -u quiverd); every bundle acknowledged "
              "before this is durable", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"quiverd: {_describe(exc)}", file=sys.stderr)
        print(f"hint: {_os_hint(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _stdout_closed() -> bool:
    """Whether stdout's reader went away (a pipe with no reader polls as an error)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # stdout replaced or closed
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _stdout_gone() -> int:
    """End quietly, as a Unix tool whose reader left: output unwritten is dropped
    (devnull over stdout, so the flush at exit does not fail again), exit status 141."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_STDOUT_CLOSED


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors in the CLI's two-line form (exit 2, as argparse)."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("quiverd").strip()
        print(f"quiverd: {command + ': ' if command else ''}{message}", file=sys.stderr)
        print(f"hint: `{self.prog} --help` lists what it takes", file=sys.stderr)
        sys.exit(2)


def _print_error(exc: QuiverError) -> None:
    print(f"quiverd: {exc}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {exc.hint}", file=sys.stderr)


def _describe(exc: OSError) -> str:
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def _os_hint(exc: OSError) -> str:
    if isinstance(exc, PermissionError):
        return "run as a user allowed to read/write that path (the daemon runs as User=quiverd)"
    if isinstance(exc, FileNotFoundError | NotADirectoryError):
        return "check the path for a typo; every directory on the way must exist"
    return "see the message above; nothing acknowledged was lost"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="quiverd", description="A durable Arrow buffer daemon.")
    p.add_argument("--version", action="version", version=f"quiverd {__version__}")
    sub = p.add_subparsers(metavar="COMMAND")

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", default=DEFAULT_CONFIG,
                   help=f"the config file (default {DEFAULT_CONFIG})")
    s.set_defaults(func=_serve)

    s = sub.add_parser("check-config", help="validate a config file")
    s.add_argument("path", help="the config file to check")
    s.add_argument("--probe", action="store_true",
                   help="also reach the lake's store (write and delete a probe object) "
                   "and catalog (connect, migrations)")
    s.set_defaults(func=_check_config)

    s = sub.add_parser("send", help="send Arrow IPC or Parquet files, one bundle per batch")
    s.add_argument("--socket", required=True, help="the daemon's ingest socket "
                   "(ingest.socket_path, by default <data_dir>/ingest.sock)")
    s.add_argument("--client", required=True,
                   help="the bundles' client name, [A-Za-z0-9._-]{1,255} (the lake's client=)")
    s.add_argument("--json", action="store_true", help="print each ack as a JSON line")
    s.add_argument("--producer-id", default="", metavar="ID",
                   help="name this producer ([A-Za-z0-9._-]{1,255}): its bundles are "
                   "numbered, and a lost connection or a daemon restart is ridden out by "
                   "reconnecting and resending what was not acked, each bundle stored "
                   "exactly once (protocol v3)")
    s.add_argument("files", nargs="+", metavar="FILE",
                   help="Arrow IPC (file or stream) or Parquet files")
    s.set_defaults(func=_send)

    for name, fn, text in (("status", _status, "daemon and per-shard counters"),):
        s = sub.add_parser(name, help=text)
        _admin_args(s)
        s.set_defaults(func=fn)

    wal = sub.add_parser("wal", help="WAL tools").add_subparsers(metavar="WAL_COMMAND",
                                                                 required=True)
    s = wal.add_parser("dump", help="print the header and every entry of a WAL file")
    s.add_argument("path", help="a WAL file (shard-<n>/wal/quiver.wal[.<gen>])")
    s.add_argument("--json", action="store_true", help="one JSON object per line")
    s.set_defaults(func=_wal_dump)

    segs = sub.add_parser("segments", help="segment listing").add_subparsers(metavar="CMD",
                                                                             required=True)
    s = segs.add_parser("list", help="finalized segments of the running daemon")
    _admin_args(s)
    s.set_defaults(func=_segments_list)

    seg = sub.add_parser("segment", help="segment file tools").add_subparsers(metavar="CMD",
                                                                              required=True)
    s = seg.add_parser("dump", help="directory, manifest, statistics, representative schemas")
    s.add_argument("path", help="a segment file (shard-<n>/segments/<seq>.qseg)")
    s.add_argument("--json", action="store_true", help="one JSON object, not indented")
    s.set_defaults(func=_segment_dump)

    subs = sub.add_parser("subscribers", help="register, remove and list subscribers"
                          ).add_subparsers(metavar="CMD", required=True)
    s = subs.add_parser("add", help="register a subscriber on every shard")
    s.add_argument("name", metavar="NAME", help="[a-z0-9_-]{1,64}")
    s.add_argument("--from", dest="start", choices=("earliest", "latest"), default="earliest",
                   help="earliest: everything retained; latest: only segments finalized later")
    _admin_args(s)
    s.set_defaults(func=_subscribers_add)
    s = subs.add_parser("remove", help="unregister a subscriber; its segments may be deleted")
    s.add_argument("name", metavar="NAME", help="a registered subscriber")
    _admin_args(s)
    s.set_defaults(func=_subscribers_remove)
    s = subs.add_parser("list", help="registered subscribers and how far behind they are")
    _admin_args(s)
    s.set_defaults(func=_subscribers_list)

    s = sub.add_parser("subscribe", help="consume as a subscriber: write files or print bundles")
    s.add_argument("name", metavar="NAME", help="a registered subscriber")
    mode = s.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", metavar="DIR",
                      help="write <shard>-<segment_seq>-<bundle_index>.slot<k>.arrow files, "
                      "ack each bundle once its files are durable")
    mode.add_argument("--count", metavar="N", type=_positive_int,
                      help="ack and print N bundles, then stop")
    s.add_argument("--json", action="store_true", help="one JSON line per bundle")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--socket", default=None, help="ingest socket path")
    where.add_argument("--config", default=None, help="config whose ingest socket to use")
    s.add_argument("--window", type=_positive_int, default=64,
                   help="bundles delivered but not yet acked (default 64, at most 4096)")
    s.add_argument("--timeout", metavar="SECONDS", type=_positive_float, default=None,
                   help="stop after this long without a delivery "
                   "(default: never with --out, 10 with --count)")
    s.set_defaults(func=_subscribe)

    s = sub.add_parser(
        "fsck", help="verify WAL, sidecars and every segment",
        epilog="exit status: 0 healthy, or every finding repaired with nothing lost; "
        "1 findings remain, acknowledged bundles were lost (LOST lines, also after --repair), "
        "or the directory was refused (not a data directory, or in use)")
    s.add_argument("data_dir", help="the data directory of a stopped daemon")
    s.add_argument("--repair", action="store_true", help="move damaged files to quarantine/")
    s.add_argument("--json", action="store_true", help="one JSON object per finding")
    from quiverd.cli.fsck_lake import add_lake_arguments

    add_lake_arguments(s)
    s.set_defaults(func=_fsck)

    from quiverd.cli.jobs import add_parsers as add_jobs_parsers

    add_jobs_parsers(sub, _admin_args, _admin_socket)
    from quiverd.cli.lake import add_parsers as add_lake_parsers

    add_lake_parsers(sub, DEFAULT_CONFIG)
    _describe_commands(p)
    return p


def _describe_commands(parser: argparse.ArgumentParser) -> None:
    """Each command's help line also heads its own ``--help``."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                command = action.choices[choice.dest]
                command.description = command.description or choice.help
                _describe_commands(command)


def _admin_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", default=None, help="config whose admin socket to use")
    s.add_argument("--socket", default=None, help="admin socket path (overrides --config)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _admin_socket(args: argparse.Namespace) -> Path:
    if args.socket:
        return Path(args.socket)
    return config_mod.load(args.config or DEFAULT_CONFIG).admin_socket


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def _serve(args: argparse.Namespace) -> int:
    from quiverd.runtime.serve import EXIT_CONFIG, serve

    try:
        cfg = config_mod.load(args.config)
    except ConfigError as exc:
        _print_error(exc)
        return EXIT_CONFIG  # systemd must not restart-loop on a bad config
    return serve(cfg)


def _check_config(args: argparse.Namespace) -> int:
    from quiverd.lake.tier import check_config as check_lake_config

    cfg = config_mod.load(args.path)
    check_lake_config(cfg)
    if args.probe:
        import anyio

        from quiverd.kernel import logs
        from quiverd.lake.tier import probe

        for line in anyio.run(probe, cfg, logs.get("check-config")):
            print(line)
    print(f"{args.path}: ok ({cfg.shard_count} shards, data_dir {cfg.data_dir})")
    return 0


def _send(args: argparse.Namespace) -> int:
    from quiverd.cli.send import send_files_cli

    return send_files_cli(args)


def _status(args: argparse.Namespace) -> int:
    from quiverd.net.admin import request

    result = request(_admin_socket(args), "status")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"quiverd pid {result['pid']}  data_dir {result['data_dir']}  "
          f"connections {result['connections']}  stopping {result['stopping']}")
    _print_ready(result)
    cols = ["shard", "wal_bytes", "wal_files", "last_sequence", "fsyncs", "acks", "in_flight",
            "open_bundles", "segments"]
    table(cols, result["shards"])
    lake = result.get("lake") or {}
    if lake.get("enabled"):
        print(f"lake {lake['state']}  store {lake['store']}  catalog {lake['catalog']}  "
              f"files_uploaded {lake['files_uploaded']}  pending_files {lake['pending_files']}  "
              f"pending_bytes {lake.get('pending_bytes', 0)}  "
              f"open_files {lake['open_files']}  unacked_bundles {lake['unacked_bundles']}"
              + ("  STORE DENIED (check lake.store credentials)" if lake["store_denied"] else ""))
        ice = lake.get("iceberg") or {}
        if ice.get("enabled") and "lag_files" in ice:
            print(f"iceberg  lag_files {ice['lag_files']}  lag_s {ice['lag_s']}  "
                  f"commits {ice['commits']}  last_commit_ms {ice['last_commit_ms']}  "
                  f"commit_p99_ms {ice['commit_p99_ms']}  files_skipped {ice['files_skipped']}"
                  + (f"  last_error {ice['last_error']}" if ice.get("last_error") else ""))
            for name, skip in (ice.get("skipped") or {}).items():
                print(f"iceberg  {name}  skipped_files {skip['files']}  skipped_rows "
                      f"{skip['rows']}  (Iceberg cannot hold them: iceberg_file_skipped in "
                      "the log says why; format(\"quiver\") reads them)")
        elif not ice.get("enabled"):
            print("iceberg off (lake.iceberg.enabled = false)")
        scrub = lake.get("scrub") or {}
        if scrub.get("last_pass_files") is not None:
            print(f"scrub  check_every_s {scrub['check_every_s']}  last_pass_files "
                  f"{scrub['last_pass_files']}  last_pass_ms {scrub['last_pass_duration_ms']}  "
                  f"corrupt_found {scrub['corrupt_found']}")
        _print_degraded(lake.get("degraded") or {})
    else:
        print("lake off (lake.enabled = false)")
    staging = result.get("staging") or {}
    if staging:
        print(f"staging {staging['state']}  jobs {staging['jobs']}  "
              f"undecided {staging['undecided_jobs']}  "
              f"staged_bytes {staging['staged_bytes']}")
        for shard, held in sorted((staging.get("holding") or {}).items()):
            print(f"  shard {shard} delivery waits for undecided job {held['job_id']} "
                  f"(age {held['age_s']} s; `quiverd jobs list`, `quiverd jobs abort`)")
    for r in result.get("retired_subscribers") or []:
        print(f"retired subscriber {r['name']}  reason {r['reason']}  lag_bytes "
              f"{r['lag_bytes']}  idle_s {r['idle_s']}  at {r['retired_at']}  "
              f"(no consumer; `quiverd subscribers add {r['name']}` brings it back)")
    return 0


def _print_ready(result: dict[str, Any]) -> None:
    """Whether appends are taken (GET /readyz), storage held, and bytes lost by reason."""
    ready, storage = result.get("ready") or {}, result.get("storage") or {}
    if not ready:
        return  # a daemon from before these fields
    over = (f"cap {storage['cap_bytes']}" if storage["cap_bytes"]
            else f"filesystem {storage['filesystem_bytes']}")
    lost = result.get("metrics", {}).get("quiver_lost_bytes_total") or {}
    print(f"ready {'yes' if ready['status'] == 'ready' else 'NO'}  storage {storage['used_bytes']}"
          f" of {over} bytes ({storage['utilisation_ratio']:.1%})  free {storage['free_bytes']}"
          + ("  lost_bytes " + " ".join(f"{k} {v}" for k, v in sorted(lost.items()))
             if lost else ""))
    for reason in ready["reasons"]:
        print(f"  NOT READY {reason}")


def _print_degraded(degraded: dict[str, dict[str, Any]]) -> None:
    """One line per degraded part of the lake: kind, since when, the last error, the hint."""
    import datetime

    for part, fault in sorted(degraded.items()):
        since = datetime.datetime.fromtimestamp(fault["since_ns"] / 1e9, datetime.UTC)
        print(f"  DEGRADED {part} ({fault['kind']}) since {since:%Y-%m-%dT%H:%M:%SZ}, "
              f"{fault['attempts']} attempts; last error: {fault['error']}"
              + (f"  hint: {fault['hint']}" if fault.get("hint") else ""))


def _segments_list(args: argparse.Namespace) -> int:
    from quiverd.net.admin import request

    rows = request(_admin_socket(args), "segments")
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    human = [{**r, "first_ingested": utc(r["min_ts_ns"]), "last_ingested": utc(r["max_ts_ns"])}
             for r in rows]
    table(["shard", "segment_seq", "bundles", "bytes", "first_ingested", "last_ingested"],
           human)
    return 0


def _subscribers_add(args: argparse.Namespace) -> int:
    from quiverd.net.admin import request

    result = request(_admin_socket(args), "subscribers.add",
                     {"name": args.name, "start": args.start})
    if args.json:
        print(json.dumps(result))
    else:
        print(f"subscriber {args.name!r} added from {args.start} on {_shards(result)}")
    return 0


def _subscribers_remove(args: argparse.Namespace) -> int:
    from quiverd.net.admin import request

    result = request(_admin_socket(args), "subscribers.remove", {"name": args.name})
    if args.json:
        print(json.dumps(result))
    else:
        print(f"subscriber {args.name!r} removed on {_shards(result)}")
    return 0


def _shards(result: dict[str, Any]) -> str:
    n = int(result["shards"])
    return f"{n} shard" if n == 1 else f"{n} shards"


def _subscribers_list(args: argparse.Namespace) -> int:
    from quiverd.net.admin import request

    rows = request(_admin_socket(args), "subscribers.list")
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table(["name", "lag_segments", "lag_bundles", "lag_bytes", "dropped_bundles"], rows)
    if not rows:
        print("(no subscribers; add one with `quiverd subscribers add NAME`)")
    return 0


def _subscribe(args: argparse.Namespace) -> int:
    from quiverd.cli.subscribe import subscribe_cli

    return subscribe_cli(args, DEFAULT_CONFIG)


def _wal_dump(args: argparse.Namespace) -> int:
    from quiverd.wal.dump import dump_wal

    bad = 0
    for row in dump_wal(Path(args.path)):
        bad += row.get("crc") == "bad" or row.get("kind") in ("torn_tail", "error", "skipped")
        if args.json:
            print(json.dumps(row, default=str))
        else:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
    return 1 if bad else 0


def _segment_dump(args: argparse.Namespace) -> int:
    from quiverd.segments.reader import describe_segment

    info = describe_segment(Path(args.path))
    print(json.dumps(info, indent=None if args.json else 2, default=str))
    return 0


def _fsck(args: argparse.Namespace) -> int:
    from quiverd.cli.fsck import run_fsck

    rc = run_fsck(Path(args.data_dir), repair=args.repair, as_json=args.json)
    if args.lake:
        from quiverd.cli.fsck_lake import run_fsck_lake

        rc = max(rc, run_fsck_lake(args))
    return rc


if __name__ == "__main__":
    from quiverd.cli.process_exit import console

    console()
