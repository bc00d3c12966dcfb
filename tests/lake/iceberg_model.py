"""What the Iceberg model test drives: the real Projector actor on real tiers (quiverd's
SQLite catalog, the fs store, real Parquet files), its Projection in this process, and a
way to "kill" a daemon in the middle of a commit so that the commit lands later (the
worker process a killed daemon leaves behind).

    Source (one data directory's incarnation: a source id)
      ├── tier        open_test_tier on the shared root: one catalog, one store for all
      ├── projector   quiverd_actors.projector.Projector, rounds driven one at a time
      └── LocalProjection ── Projection (pyiceberg SQL catalog on catalog.sqlite)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import anyio
from pyiceberg.catalog.sql import SqlCatalog

from quiverd.kernel.metrics import Metrics
from quiverd.lake.health import LakeHealth
from quiverd.lake.iceberg import Projection
from quiverd.lake.tier import Tier
from quiverd_actors.projector import Projector
from tests.lake.catalogs import Log

MUTATING = frozenset({"commit", "sync"})  # Projection methods that write a snapshot


class Killed(BaseException):
    """The daemon died at this call: nothing in the projector may catch it."""


class LocalProjection:
    """``RemoteProjection``'s interface on a ``Projection`` of this process (threads).

    ``freeze()``: the next call that writes a snapshot is not run but kept (``captured``)
    and ``Killed`` is raised in the caller, as if the daemon died while its worker held
    the call; ``land()`` runs it later, as that outliving worker would."""

    def __init__(self, projection: Projection) -> None:
        self.projection = projection
        self.frozen = False
        self.captured: Callable[[], Any] | None = None

    def freeze(self) -> None:
        self.frozen = True

    def land(self) -> Any:
        call, self.captured = self.captured, None
        return None if call is None else call()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.projection, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            bound = functools.partial(method, *args, **kwargs)
            if self.frozen and name in MUTATING:
                self.captured = bound
                raise Killed(name)
            return await anyio.to_thread.run_sync(bound)

        return call


def new_projector(tier: Tier, projection: LocalProjection) -> Projector:
    log = Log()
    return Projector(tier, projection, log=log, metrics=Metrics(),  # type: ignore[arg-type]
                     health=LakeHealth(log=log))


def snapshot_paths(catalog: SqlCatalog, table: str) -> tuple[int | None, list[str], list[Any]]:
    """(current snapshot id, the data file paths of the current snapshot with duplicates
    kept, every snapshot) of ``quiver.<table>``, read afresh; (None, [], []) if absent."""
    from pyiceberg.exceptions import NoSuchTableError

    try:
        tbl = catalog.load_table(("quiver", table.split(".", 1)[1]))
    except NoSuchTableError:
        return None, [], []
    snap = tbl.metadata.current_snapshot()
    if snap is None:
        return None, [], list(tbl.metadata.snapshots)
    paths = [entry.data_file.file_path for manifest in snap.manifests(tbl.io)
             for entry in manifest.fetch_manifest_entry(tbl.io, discard_deleted=True)]
    return snap.snapshot_id, paths, list(tbl.metadata.snapshots)
