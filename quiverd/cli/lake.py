"""Lake commands: they open the catalog and the store named by the config directly,
so they work whether or not the daemon runs.

    quiverd files list [--client C] [--since T] [--until T] [--state S] [--json]
    quiverd files show FILE_ID [--json]
    quiverd files restore FILE_ID [--from PATH] [--json]
    quiverd files forget FILE_ID [--json]
    quiverd janitor [--dry-run] [--json]
    quiverd compact [--client C] [--dry-run] [--json]
    quiverd dead-letters [--client C] [--json] [--replay SOCKET]

Times are ISO-8601 (``2026-11-24T10:00:00Z``; no zone means UTC) or integer
nanoseconds since the epoch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec

from quiverd.cli.output import table, utc
from quiverd.kernel import config as config_mod
from quiverd.kernel import logs
from quiverd.kernel.config import Config
from quiverd.kernel.errors import ConfigError
from quiverd.lake.model import REGISTERED, FileRow, FileState

if TYPE_CHECKING:  # the lake's code (OpenDAL, Parquet) loads only for a lake command
    from quiverd.lake.tier import Tier

T = TypeVar("T")
LIST_COLUMNS = ["file_id", "client_name", "slot", "state", "rows", "bytes", "start", "end"]
STORE_LIST_LIMIT = 200_000  # objects one `files list` lists; the rest are stat'ed
MISSING = "MISSING"
QUARANTINED = "quarantined"
LOST = "lost"  # forgotten: `quiverd files forget`


def add_parsers(sub: Any, default_config: str) -> None:
    files = sub.add_parser("files", help="lake files registered in the catalog"
                           ).add_subparsers(metavar="CMD", required=True)
    s = files.add_parser("list", help="registered files, oldest first")
    s.add_argument("--client", help="only this client's files")
    s.add_argument("--since", type=parse_time, help="files ending at or after this time")
    s.add_argument("--until", type=parse_time, help="files starting before this time")
    s.add_argument("--state", action="append", choices=[st.value for st in FileState],
                   help="only these states (repeatable; default: the registered and the "
                   "quarantined ones); column object: ok, MISSING from the store, "
                   "quarantined, lost")
    s.add_argument("--limit", type=int, default=None, help="at most this many files")
    _common(s, default_config)
    s.set_defaults(func=files_list)
    s = files.add_parser("show", help="one file's row and zone maps")
    s.add_argument("file_id", help="a file id (ULID) from `quiverd files list`")
    _common(s, default_config)
    s.set_defaults(func=files_show)
    s = files.add_parser(
        "restore", help="make a quarantined (or lost) file live again from a copy with the "
        "catalog's size and CRC-32C; also puts back a registered file's missing object")
    s.add_argument("file_id", help="a file id (ULID), e.g. from `quiverd fsck DATA_DIR --lake`")
    s.add_argument("--from", dest="source", metavar="PATH", default=None,
                   help="a local copy (a backup) to check and upload to the file's key; "
                   "without it the object already at the key is checked (e.g. restored "
                   "from the store's versioning)")
    _common(s, default_config)
    s.set_defaults(func=files_restore)
    s = files.add_parser("forget", help="record a quarantined file as lost: its rows are "
                         "gone from the lake; reads stop failing on it")
    s.add_argument("file_id", help="a quarantined file's id (ULID)")
    _common(s, default_config)
    s.set_defaults(func=files_forget)

    s = sub.add_parser("dead-letters", help="bundles the lake could not write, set aside "
                       "and rejected (lake.dead_letter_after); --replay sends them again")
    s.add_argument("--client", help="only this client's")
    s.add_argument("--replay", metavar="SOCKET", default=None,
                   help="send each listed dead letter's rows again, as new bundles of its "
                   "client, to the daemon at this ingest socket (once the cause is fixed); "
                   "a replayed dead letter leaves its Iceberg table, and its object is "
                   "deleted, once its bundle is acked")
    _common(s, default_config)
    s.set_defaults(func=dead_letters_cmd)

    s = sub.add_parser("janitor", help="reconcile the object store with the catalog: "
                       "orphan objects, rows without objects, replaced and stale files")
    s.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    _common(s, default_config)
    s.set_defaults(func=janitor)
    s = sub.add_parser("compact", help="merge small registered files of a client")
    s.add_argument("--client", help="only this client's files (default: every client)")
    s.add_argument("--dry-run", action="store_true", help="show the plan, write nothing")
    _common(s, default_config)
    s.set_defaults(func=compact)


def _common(s: argparse.ArgumentParser, default_config: str) -> None:
    s.add_argument("--config", default=default_config,
                   help=f"whose catalog and object store (default {default_config})")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")


def parse_time(text: str) -> int:
    """ISO-8601 (UTC when no zone is given) or integer ns -> ns since the epoch."""
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither ISO-8601 (2026-11-24T10:00:00Z) nor integer ns") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return int(when.timestamp() * 1_000_000_000)


def files_list(args: argparse.Namespace) -> int:
    states = ([FileState(s) for s in args.state] if args.state
              else [FileState.META_REGISTERED, FileState.INDEXED, FileState.EVICTED,
                    FileState.QUARANTINED])

    async def go(tier: Tier) -> tuple[list[FileRow], dict[str, str]]:
        rows = await tier.catalog.list_files(client=args.client, since_ns=args.since,
                                             until_ns=args.until, states=states,
                                             limit=args.limit)
        return rows, await _object_marks(tier, rows, args.client)

    rows, marks = _with_tier(args, go)
    if args.json:
        print(json.dumps([{**msgspec.to_builtins(r), "object": marks.get(r.file_id, "")}
                          for r in rows], indent=2))
        return 0
    table([*LIST_COLUMNS, "object"], [{**_summary(r), "object": marks.get(r.file_id, "")}
                                      for r in rows], left=True)
    if not rows:
        print("(no files)")
    bad = sum(1 for m in marks.values() if m in (MISSING, QUARANTINED))
    if bad:
        print(f"{bad} file{'s' * (bad != 1)} without a readable object (MISSING: the store "
              "has none; quarantined: damaged, moved to quarantine/): `quiverd files "
              "restore FILE_ID --from PATH` puts a backup back, `quiverd files forget "
              "FILE_ID` records a quarantined one as lost")
    return 0


async def _object_marks(tier: Tier, rows: list[FileRow], client: str | None
                        ) -> dict[str, str]:
    """file_id -> "ok" | MISSING | QUARANTINED for rows that should have an object
    (registered or quarantined); one listing of the store, a stat for what it lacks."""
    marks = {r.file_id: QUARANTINED for r in rows if r.state is FileState.QUARANTINED}
    marks.update({r.file_id: LOST for r in rows if r.state is FileState.LOST})
    wanted = [r for r in rows if r.state in REGISTERED and r.object_key]
    if not wanted:
        return marks
    prefix = f"client={client}/" if client else ""
    listed = {o.key for o in await tier.store.list(prefix, limit=STORE_LIST_LIMIT)}
    for r in wanted:
        present = r.object_key in listed or await tier.store.stat(r.object_key) is not None
        marks[r.file_id] = "ok" if present else MISSING
    return marks


def files_show(args: argparse.Namespace) -> int:
    async def go(tier: Tier) -> dict[str, Any] | None:
        row = await tier.catalog.get(args.file_id)
        if row is None:
            return None
        maps = (await tier.catalog.zone_maps([row.file_id])).get(row.file_id, [])
        return {**msgspec.to_builtins(row), "zone_maps": msgspec.to_builtins(maps)}

    found = _with_tier(args, go)
    if found is None:
        raise ConfigError("file_id", f"no lake file {args.file_id!r} in the catalog",
                          hint="`quiverd files list` shows the registered files")
    print(json.dumps(found, indent=None if args.json else 2))
    return 0


def files_restore(args: argparse.Namespace) -> int:
    from quiverd.lake.restore import restore_file

    source = Path(args.source) if args.source else None
    if source is not None and not source.is_file():
        raise ConfigError("--from", f"{source} is not a file",
                          hint="pass the backup copy of the lake file (a .parquet file)")

    async def go(tier: Tier) -> tuple[Any, bool, float]:
        ice = tier.cfg.lake.iceberg
        return await restore_file(tier, args.file_id, source), ice.enabled, \
            ice.reconcile_interval_s

    done, iceberg, interval = _with_tier(args, go)
    if args.json:
        print(json.dumps(msgspec.to_builtins(done)))
        return 0
    if not done.changed:
        print(f"lake file {done.file_id} is {done.state} and its object at {done.uri} has "
              "the catalog's size and CRC-32C: nothing to restore")
        return 0
    where = "the object at its key" if done.source == "store" else done.source
    print(f"restored lake file {done.file_id} ({done.rows} rows) from {where}: size and "
          f"CRC-32C match the catalog; state {done.state}, live again at {done.uri}")
    if iceberg:
        print(f"the Iceberg projection adds it back at its next reconcile (every {interval:g} s "
              "while the daemon runs, or at its next start)")
    return 0


def files_forget(args: argparse.Namespace) -> int:
    from quiverd.lake.restore import bundle_range, forget_file

    row, moved = _with_tier(args, lambda tier: forget_file(tier, args.file_id))
    if args.json:
        print(json.dumps({**msgspec.to_builtins(row), "forgotten_now": moved}))
        return 0
    if not moved:
        print(f"lake file {row.file_id} was already recorded as lost: nothing changed")
        return 0
    print(f"LOST  lake file {row.file_id} (client {row.client_name} slot {row.slot}, "
          f"{row.row_count} rows, bundles {bundle_range(row)}) is recorded as lost: its rows "
          "are not in the lake; reads no longer fail on it and `quiverd fsck --lake` lists "
          "it as KNOWN; the damaged copy stays under quarantine/ in the store, and `quiverd "
          "files restore FILE_ID --from PATH` still brings the file back")
    return 0


def dead_letters_cmd(args: argparse.Namespace) -> int:
    from quiverd.lake import dead_letters as dl

    async def go(tier: Tier) -> tuple[list[dl.DeadLetter], dict[str, bool]]:
        prefix = dl.PREFIX + (f"client={args.client}/" if args.client else "")
        found: list[dl.DeadLetter] = []
        for obj in sorted(await tier.store.list(prefix), key=lambda o: o.key):
            found += dl.read(obj.key, await tier.store.read(obj.key))
        return found, await _in_tables(tier, found)

    found, in_table = _with_tier(args, go)
    if args.json and not args.replay:
        print(json.dumps([{k: v for k, v in vars(d).items() if k != "payload"}
                          | {"payload_bytes": len(d.payload), "in_table": in_table.get(d.key)}
                          for d in found], indent=2))
    elif not args.replay:
        for d in found:
            table = {True: "", False: "  NOT IN TABLE"}.get(in_table.get(d.key, True), "")
            print(f"{d.client}  bundle ({d.shard}, {d.segment_seq}, {d.bundle_index}) slot "
                  f"{d.slot}  rows {d.rows}  attempts {d.attempts}  {d.reason}{table}  "
                  f"{d.error[:160]}")
        print(f"({len(found)} dead letters)")
    if not args.replay:
        return 0
    from quiverd.client import Client

    by_key: dict[str, list[dl.DeadLetter]] = {}
    for d in found:
        by_key.setdefault(d.key, []).append(d)
    sent: list[str] = []
    try:
        with Client.connect(args.replay, producer_id="dead-letter-replay") as c:
            for key, slots in by_key.items():
                c.send({d.slot: d.table() for d in slots}, client=slots[0].client)
                sent.append(key)  # acked: its object may go
                print(f"replayed {key}")
    finally:
        async def drop(tier: Tier) -> None:  # one store connection for every delete
            # Out of the table first: a reader of it never finds a file without its object.
            await _drop_from_tables(tier, {k: by_key[k][0].client for k in sent})
            for key in sent:
                await tier.store.delete(key)

        if sent:
            _with_tier(args, drop)
    print(f"({len(sent)} dead letters sent again and deleted)")
    return 0


async def _in_tables(tier: Tier, found: list[Any]) -> dict[str, bool]:
    """object key -> whether its client's dead-letter table holds it ({} when the
    Iceberg projection is off: there are no tables)."""
    from quiverd.kernel.errors import LakeError

    held: dict[str, set[str]] = {}
    try:
        tables = await _dead_letter_tables(tier)
        if tables is None:
            return {}
        try:
            for client in sorted({d.client for d in found}):
                held[client] = await anyio.to_thread.run_sync(tables.locations, client)
        finally:
            await anyio.to_thread.run_sync(tables.close)
    except LakeError as exc:  # the objects are the list; the tables only mirror them
        print(f"warning: the dead-letter tables could not be read ({exc}); listing the "
              "objects only", file=sys.stderr)
        return {}
    return {d.key: tier.store.location(d.key) in held[d.client] for d in found}


async def _drop_from_tables(tier: Tier, clients: dict[str, str]) -> None:
    """Delete the dead letters ``clients`` (object key -> client) from their tables."""
    tables = await _dead_letter_tables(tier) if clients else None
    if tables is None:
        return
    try:
        by_client: dict[str, list[str]] = {}
        for key, client in clients.items():
            by_client.setdefault(client, []).append(tier.store.location(key))
        for client, locations in sorted(by_client.items()):
            await anyio.to_thread.run_sync(tables.remove, client, locations)
    finally:
        await anyio.to_thread.run_sync(tables.close)


async def _dead_letter_tables(tier: Tier) -> Any:
    if not tier.cfg.lake.iceberg.enabled:
        return None
    from quiverd.lake.iceberg.dead_letters import DeadLetterTables, settings_of

    s = settings_of(tier.cfg, tier.store.location(""), tier.store.iceberg_io_properties())
    return await anyio.to_thread.run_sync(lambda: DeadLetterTables(
        catalog_uri=s.catalog_uri, warehouse=s.warehouse, io_properties=s.io_properties,
        cfg=s.cfg))


def janitor(args: argparse.Namespace) -> int:
    from quiverd.lake.iceberg.held import snapshot_holds
    from quiverd.lake.janitor import sweep

    async def go(tier: Tier) -> Any:
        held = snapshot_holds(tier) if tier.cfg.lake.iceberg.enabled else None
        return await sweep(tier, dry_run=args.dry_run, held=held)

    report = msgspec.to_builtins(_with_tier(args, go))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            shown = len(value) if isinstance(value, list) else value
            print(f"{key}: {shown}")
            if isinstance(value, list):
                for item in value[:20]:
                    print(f"  {item}")
    missing = report.get("rows_missing_objects") or []
    return 1 if missing else 0


def compact(args: argparse.Namespace) -> int:
    from quiverd.lake.compaction import compact as run_compact

    async def go(tier: Tier) -> Any:
        return await run_compact(tier, client=args.client, dry_run=args.dry_run,
                                 limiter=anyio.CapacityLimiter(
                                     tier.cfg.lake.compaction.parallelism),
                                 log=tier.log)

    results = msgspec.to_builtins(_with_tier(args, go))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print("  ".join(f"{k}={v}" for k, v in r.items()))
        if not results:
            print("(nothing to compact)")
    return 0


def _with_tier(args: argparse.Namespace, fn: Callable[[Tier], Awaitable[T]]) -> T:
    cfg: Config = config_mod.load(args.config)
    logs.configure("console", "warning")

    from quiverd.lake.tier import open_tier

    async def main() -> T:
        async with open_tier(cfg, logs.get("cli")) as tier:
            return await fn(tier)

    return anyio.run(main)


def _summary(r: FileRow) -> dict[str, Any]:
    return {"file_id": r.file_id, "client_name": r.client_name, "slot": r.slot,
            "state": r.state.value, "rows": r.row_count, "bytes": r.compressed_size,
            "start": utc(r.start_ts), "end": utc(r.end_ts)}
