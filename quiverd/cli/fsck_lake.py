"""``quiverd fsck DATA_DIR --lake [--config PATH] [--no-crc] [--repair] [--json]``: the
lake of a data directory checked against its catalog, after the shard checks.

    catalog rows of this node                 object store
    MetaRegistered / Indexed / Evicted ─────▶ stat: absent      FINDING lake_object_missing
                                              size differs      FINDING lake_object_corrupt
                                              read all: CRC-32C FINDING lake_object_corrupt
    Quarantined ────────────────────────────▶ LOST: its rows are no longer in the lake
    Lost (`quiverd files forget`) ──────────▶ KNOWN: that loss, reported before

The catalog and store are those of ``--config`` (whose ``data_dir`` must be DATA_DIR),
or without it the embedded defaults: ``DATA_DIR/catalog.sqlite`` and the fs store under
``DATA_DIR/objects``. Every object is read in full for its CRC-32C (``--no-crc``: stat
only). Nothing is written unless ``--repair``, which quarantines damaged objects as the
lake scrub does (``quarantine/<key>`` in the store, row Quarantined). A missing object
or a quarantined file cannot be repaired here: ``quiverd files restore FILE_ID --from
PATH`` puts a backup back (checked against the row's size and CRC-32C), ``quiverd
files forget FILE_ID`` records a quarantined file as lost.

Exit status as fsck's: 1 when a FINDING remains or a LOST line is printed (a
quarantined file's rows are not in the lake until it is restored), else 0. KNOWN lines
(files recorded as lost) do not count: that loss was reported when it was recorded.
A data directory whose lake never ran (no ``lake.id``, no embedded catalog) is
reported as such and is healthy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from quiverd.kernel import config as config_mod
from quiverd.kernel import logs
from quiverd.kernel.config import Config
from quiverd.kernel.errors import ConfigError
from quiverd.kernel.layout import DataDir
from quiverd.lake.model import REGISTERED, RESTORABLE, FileRow, FileState

if TYPE_CHECKING:
    from quiverd.lake.tier import Tier

LIST_LIMIT = 200_000
FINDINGS_SHOWN = 1_000


class LakeFinding(msgspec.Struct, kw_only=True):
    kind: str  # lake_object_missing | lake_object_corrupt
    file_id: str
    uri: str
    message: str


class LakeReport(msgspec.Struct, kw_only=True):
    node_id: str = ""
    catalog: str = ""
    store: str = ""
    files: int = 0
    bytes: int = 0
    crc_checked: bool = True
    findings: list[LakeFinding] = msgspec.field(default_factory=list)
    lost: list[LakeFinding] = msgspec.field(default_factory=list)  # quarantined files
    known_lost: list[LakeFinding] = msgspec.field(default_factory=list)  # forgotten files
    repairs: list[dict[str, str]] = msgspec.field(default_factory=list)
    note: str = ""

    @property
    def healthy(self) -> bool:
        return not self.findings and not self.lost


def add_lake_arguments(s: argparse.ArgumentParser) -> None:
    """fsck's lake flags (quiverd/cli/main.py adds them to ``fsck``)."""
    s.add_argument("--lake", action="store_true",
                   help="also check the lake: every registered object of this node against "
                   "its catalog row (present, size, CRC-32C); quarantined files are LOST")
    s.add_argument("--config", default=None,
                   help="with --lake: the config naming the catalog and store (default: "
                   "the embedded catalog and fs store of DATA_DIR)")
    s.add_argument("--no-crc", action="store_true",
                   help="with --lake: stat objects only, do not read them for their CRC-32C")


def run_fsck_lake(args: argparse.Namespace) -> int:
    """The lake part of ``quiverd fsck``; 0 healthy, 1 findings or lost files."""
    data_dir = Path(args.data_dir)
    cfg = _config(data_dir, args.config)
    logs.configure("console", "warning")
    report = LakeReport(crc_checked=not args.no_crc)
    data = DataDir(data_dir)
    if not data.lake_id.exists() and not (cfg.catalog.dsn or data.catalog_db.exists()):
        report.note = "no lake: this data directory has no lake.id and no catalog"
    else:
        report = anyio.run(_check, cfg, report, args.repair)
    if args.json:
        print(json.dumps({"lake": {"healthy": report.healthy, **msgspec.to_builtins(report)}}))
    else:
        _print(report)
    return 0 if report.healthy else 1


def _config(data_dir: Path, path: str | None) -> Config:
    if path is None:
        return Config(data_dir=str(data_dir.resolve()))
    cfg = config_mod.load(path)
    if Path(cfg.data_dir).resolve() != data_dir.resolve():
        raise ConfigError("data_dir", f"{path} names {cfg.data_dir}, not {data_dir}",
                          hint="pass the config of the daemon whose data directory is "
                          "checked, or no --config for the embedded catalog and fs store")
    return cfg


async def _check(cfg: Config, report: LakeReport, repair: bool) -> LakeReport:
    from quiverd.lake.tier import open_tier

    async with open_tier(cfg, logs.get("fsck")) as tier:
        report.node_id, report.catalog = tier.node_id, tier.catalog.backend
        report.store = tier.store.uri("")
        rows = await tier.catalog.list_files(node_id=tier.node_id,
                                             states=REGISTERED | RESTORABLE,
                                             limit=LIST_LIMIT)
        for row in rows:
            if row.state is FileState.QUARANTINED:
                report.lost.append(_lost(tier, row))
                continue
            if row.state is FileState.LOST:
                report.known_lost.append(_known(row))
                continue
            report.files += 1
            report.bytes += row.compressed_size
            finding = await _check_row(tier, row, crc=report.crc_checked)
            if finding is None:
                continue
            if repair and finding.kind == "lake_object_corrupt":
                await _repair(tier, row, finding, report)
            else:
                report.findings.append(finding)
    return report


async def _check_row(tier: Tier, row: FileRow, *, crc: bool) -> LakeFinding | None:
    from quiverd.lake.scrub import check_object

    what = (f"lake file {row.file_id} (client {row.client_name} slot {row.slot}, "
            f"{row.row_count} rows)")
    try:
        if crc:
            reason = await check_object(tier, row)
        else:
            info = await tier.store.stat(row.object_key)
            if info is None:
                raise FileNotFoundError(row.uri)
            reason = None if info.size == row.compressed_size else (
                f"{info.size} bytes in the store, the catalog says {row.compressed_size}")
    except FileNotFoundError:
        return LakeFinding(kind="lake_object_missing", file_id=row.file_id, uri=row.uri,
                           message=f"{what} is registered but the store has no object: "
                           "`quiverd files restore FILE_ID --from PATH` puts a backup back "
                           "(or restore the key from the store's versioning, then `quiverd "
                           "files restore FILE_ID` checks it)")
    if reason is None:
        return None
    return LakeFinding(kind="lake_object_corrupt", file_id=row.file_id, uri=row.uri,
                       message=f"{what}: {reason}; `quiverd fsck DATA_DIR --lake --repair` "
                       "quarantines it")


async def _repair(tier: Tier, row: FileRow, finding: LakeFinding, report: LakeReport) -> None:
    from quiverd.lake.scrub import quarantine_file

    moved = await quarantine_file(tier, row, finding.message)
    report.repairs.append({"event": "lake_object_quarantined", "file_id": row.file_id,
                           "to": moved or "(row changed meanwhile: not moved)"})
    quarantined = await tier.catalog.get(row.file_id)
    if quarantined is not None and quarantined.state is FileState.QUARANTINED:
        report.lost.append(_lost(tier, quarantined))
    else:
        report.findings.append(finding)


def _lost(tier: Tier, row: FileRow) -> LakeFinding:
    from quiverd.lake.scrub import QUARANTINE_PREFIX

    where = tier.store.uri(QUARANTINE_PREFIX + row.object_key)
    return LakeFinding(
        kind="lake_file_quarantined", file_id=row.file_id, uri=row.uri,
        message=f"lake file {row.file_id} (client {row.client_name} slot {row.slot}, "
        f"{row.row_count} rows, bundles ({row.shard}, {row.first_segment}, "
        f"{row.first_bundle})..({row.shard}, {row.last_segment}, {row.last_bundle})) is "
        f"quarantined, its damaged object at {where}: its rows are not in the lake; "
        f"`quiverd files restore {row.file_id} --from PATH` puts a backup back, or re-ingest "
        f"the rows and `quiverd files forget {row.file_id}` records the file as lost")


def _known(row: FileRow) -> LakeFinding:
    return LakeFinding(
        kind="lake_file_lost", file_id=row.file_id, uri=row.uri,
        message=f"lake file {row.file_id} (client {row.client_name} slot {row.slot}, "
        f"{row.row_count} rows, bundles ({row.shard}, {row.first_segment}, "
        f"{row.first_bundle})..({row.shard}, {row.last_segment}, {row.last_bundle})) was "
        "recorded as lost (`quiverd files forget`): its rows are not in the lake")


def _print(report: LakeReport) -> None:
    if report.note:
        print(f"lake: {report.note}")
        return
    how = "size and CRC-32C" if report.crc_checked else "size"
    print(f"lake: {report.files} files ({report.bytes} bytes) of node {report.node_id} in the "
          f"{report.catalog} catalog, checked for {how} in {report.store}")
    for r in report.repairs:
        print(f"repair  {r['event']}  file_id={r['file_id']}  to={r['to']}")
    for f in report.findings[:FINDINGS_SHOWN]:
        print(f"FINDING  {f.kind}  {f.uri}: {f.message}")
    if len(report.findings) > FINDINGS_SHOWN:
        print(f"... and {len(report.findings) - FINDINGS_SHOWN} more findings not listed")
    for f in report.lost[:FINDINGS_SHOWN]:
        print(f"LOST  {f.message}")
    for f in report.known_lost[:FINDINGS_SHOWN]:
        print(f"KNOWN  {f.message} (reported when it was recorded)")
    if report.healthy:
        print("lake healthy")
        return
    parts = []
    if report.findings:
        n = len(report.findings)
        parts.append(f"{n} lake finding{'s' * (n != 1)}")
    if report.lost:
        n = len(report.lost)
        parts.append(f"{n} quarantined lake file{'s' * (n != 1)} (LOST above)")
    print("; ".join(parts))


__all__ = ["add_lake_arguments", "run_fsck_lake"]
