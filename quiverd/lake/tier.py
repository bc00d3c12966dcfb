"""The storage tier as one value: config, object store, catalog, node and source ids.

    Tier ── store   (lake.store.ObjectStore: OpenDAL, fs under <data_dir>/objects by default)
       ├── catalog (lake.catalog: PostgreSQL when catalog.dsn is set, else catalog.sqlite)
       ├── node_id    lake.node_id or the host name: part of every object key, so several
       │              daemons can share one bucket and one catalog
       └── source_id  this data directory's incarnation, a ULID kept in <data_dir>/lake.id

Why a source id: bundle ids ``(shard, segment_seq, bundle_index)`` restart at 0 in a
new data directory, while a shared catalog outlives it. Coverage is keyed by source
id, so a wiped data directory on the same host can never find its new bundles
"already uploaded" under an old directory's rows.

Object keys: ``client=<client>/slot=<slot>/date=YYYY-MM-DD/hour=HH/<file name>``, the
node id in the file name (``lake.partitions``, ``lake.parquet.file_name``; keys of the
older ``client=<client>/slot=<slot>/<node_id>/<file name>`` layout stay valid). The
``client=`` prefix keeps a client called ``..`` a plain path component.

Startup (``recover``): rows this source left unfinished (Received .. Uploaded) are a
crash's leftovers. Their bundles were never acked, so they will be delivered again:
the object (if any) and the local file are deleted and the row becomes Abandoned.
Active files and Stable files without a registered row are deleted for the same
reason. Nothing here can lose data: only registered files are trusted.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
from ulid import ULID

from quiverd.kernel import fs
from quiverd.kernel.config import Config
from quiverd.kernel.durable import atomic_write, make_dirs
from quiverd.kernel.errors import CatalogUnavailable, ConfigError, LakeError
from quiverd.kernel.layout import DataDir
from quiverd.kernel.logs import Logger
from quiverd.kernel.names import node_id_problem
from quiverd.lake.catalog import Catalog, open_catalog
from quiverd.lake.model import REGISTERED, UNFINISHED, FileRow, FileState
from quiverd.lake.partitions import Hour, hour_dirs
from quiverd.lake.store import ObjectStore, open_store, opendal_options


@dataclass
class Tier:
    cfg: Config
    data: DataDir
    store: ObjectStore
    catalog: Catalog
    node_id: str
    source_id: str
    log: Logger

    def object_key(self, client: str, slot: int, file_name: str, hour: Hour) -> str:
        """Where a file of partition ``hour`` (None: null partition) goes in the store."""
        return f"client={client}/slot={slot}/{hour_dirs(hour)}/{file_name}"

    async def recover(self) -> int:
        """Abandon this source's unfinished files and clear staging; returns rows abandoned."""
        rows = await self.catalog.list_files(source_id=self.source_id, states=UNFINISHED)
        for row in rows:
            await self.abandon(row, reason="unfinished_at_startup")
        keep = {Path(r.local_path).name for r in await self.catalog.list_files(
            source_id=self.source_id, states=REGISTERED) if r.local_path}
        removed = await anyio.to_thread.run_sync(_clear_staging, self.data, keep)
        if rows or removed:
            self.log.info("lake_recovered", abandoned=len(rows), staging_files_removed=removed)
        return len(rows)

    async def abandon(self, row: FileRow, *, reason: str, quiet: bool = False) -> None:
        """Delete what an unregistered file left (object, local copy); row -> Abandoned.
        ``quiet``: an expected end (a staged file whose attempt lost), logged at info."""
        if row.object_key:
            await self.store.delete(row.object_key)
        if row.local_path:
            await anyio.to_thread.run_sync(_unlink, Path(row.local_path))
        await self.catalog.set_state(row.file_id, FileState.ABANDONED, local_path="")
        (self.log.info if quiet else self.log.warning)(
            "lake_file_abandoned", file_id=row.file_id, client=row.client_name, slot=row.slot,
            reason=reason, object_key=row.object_key or None)



@asynccontextmanager
async def open_tier(cfg: Config, log: Logger) -> AsyncIterator[Tier]:
    """Open the store and the catalog (migrations applied); close both on exit.

    Raises CatalogUnavailable when the catalog cannot be reached: the daemon's
    uploader retries, a CLI command reports it.
    """
    data = DataDir(Path(cfg.data_dir))
    node_id = cfg.lake.node_id or socket.gethostname()
    validate_node_id(node_id)
    source_id = await anyio.to_thread.run_sync(load_source_id, data)
    store = open_store(cfg.lake.store, data_dir=data.root, log=log)
    catalog = open_catalog(cfg.catalog, data.catalog_db, log=log)
    try:
        await catalog.start()
        tier = Tier(cfg=cfg, data=data, store=store, catalog=catalog, node_id=node_id,
                    source_id=source_id, log=log)
        yield tier
    finally:
        with anyio.CancelScope(shield=True):
            await catalog.close()
            await store.close()


def check_config(cfg: Config) -> None:
    """What config validation cannot see from the kernel: the store's options (OpenDAL
    accepts unknown keys silently) and the node id. Raises ConfigError; no I/O."""
    if not cfg.lake.enabled:
        return
    validate_node_id(cfg.lake.node_id or socket.gethostname())
    opendal_options(cfg.lake.store, data_dir=Path(cfg.data_dir))


async def probe(cfg: Config, log: Logger) -> list[str]:
    """``check-config --probe``: reach the store (write and delete a probe object under
    ``quiverd-probe/``) and the catalog (connect, apply migrations as the daemon would).
    One line per part on success; raises the part's error (with its hint) otherwise."""
    check_config(cfg)
    if not cfg.lake.enabled:
        return ["lake: off (lake.enabled = false), nothing to probe"]
    data = DataDir(Path(cfg.data_dir))
    node_id = cfg.lake.node_id or socket.gethostname()
    store = open_store(cfg.lake.store, data_dir=data.root, log=log)
    key = f"quiverd-probe/{node_id}-{ULID()}"
    try:
        await store.probe(key)
    except LakeError as exc:
        raise type(exc)(f"probe of lake.store ({store.uri('')}) failed: {exc}") from exc
    lines = [f"store {store.uri('')}: ok (wrote, read back and deleted {key})"]
    if cfg.catalog.dsn or data.root.is_dir():
        lines.append(await _probe_catalog(cfg, data.catalog_db, log, ""))
        return lines
    # A fresh install: the embedded catalog lives in data_dir, which serve creates at its
    # first start. The probe creates nothing there; it checks that serve could create it
    # and migrates a scratch catalog, so the answer matches what serve will do.
    parent = data.root.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        what = ("does not exist" if not parent.exists() else "is not a directory"
                if not parent.is_dir() else "is not writable by this user")
        raise ConfigError("data_dir", f"probe of the catalog (sqlite) failed: {data.root} "
                          f"does not exist and its parent {parent} {what}",
                          hint="fix data_dir, or create it for the daemon's user (systemd: "
                          "StateDirectory= creates /var/lib/quiverd); run the probe as that user")
    with tempfile.TemporaryDirectory(prefix="quiverd-probe-") as scratch:
        lines.append(await _probe_catalog(
            cfg, Path(scratch) / data.catalog_db.name, log,
            f"; {data.root} does not exist yet: serve creates it, the schema was migrated "
            "on a scratch copy"))
    return lines


async def _probe_catalog(cfg: Config, db_path: Path, log: Logger, note: str) -> str:
    catalog = open_catalog(cfg.catalog, db_path, log=log)
    try:
        await catalog.start()
    except CatalogUnavailable as exc:
        raise CatalogUnavailable(f"probe of the catalog ({catalog.backend}) failed: {exc}"
                                 ) from exc
    finally:
        with anyio.CancelScope(shield=True):
            await catalog.close()
    return f"catalog {catalog.backend}: ok (connected, schema migrated{note})"


def validate_node_id(node_id: str) -> None:
    if (problem := node_id_problem(node_id)) is not None:
        raise ConfigError("lake.node_id", problem, hint="set lake.node_id explicitly")


def load_source_id(data: DataDir) -> str:
    """This data directory's incarnation: read ``lake.id``, or create it durably."""
    try:
        text = data.lake_id.read_text().strip()
    except FileNotFoundError:
        text = ""
    if text:
        try:
            return str(ULID.from_str(text))
        except ValueError as exc:
            raise ConfigError("", f"{data.lake_id} holds {text!r}, not a ULID",
                              hint="restore the file from a backup; deleting it makes "
                              "redelivered bundles look new to the catalog") from exc
    value = str(ULID())
    make_dirs(data.root)
    atomic_write(data.lake_id, (value + "\n").encode(), mode=0o644)
    return value


def _clear_staging(data: DataDir, keep: set[str]) -> int:
    """Delete every Active file and every Stable file not in ``keep``; make the dirs."""
    removed = 0
    for directory, keep_names in ((data.staging_active, set()), (data.staging_stable, keep)):
        make_dirs(directory)
        for path in directory.iterdir():
            if path.name not in keep_names:
                _unlink(path)
                removed += 1
    return removed


def _unlink(path: Path) -> None:
    fs.active().unlink(path, missing_ok=True)
