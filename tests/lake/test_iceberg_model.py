"""The Iceberg projection against a model: interleavings of register, compact, projector
rounds, reconcile, expire, kill -9 (also in the middle of a commit, whose worker then
lands it late) and two sources on one catalog, on the real parts (the Projector actor,
quiverd's catalog, the fs store, real Parquet files, pyiceberg's SQL catalog).

Checked after EVERY step, for each table:
  * no data file twice and no row twice in the current snapshot (a row is known by the
    file that first held it; a compaction output holds the rows of its inputs);
  * every file of the current snapshot is one quiverd's catalog knows;
  * per source: when the source committed in this step, its files in the table are
    exactly the catalog's registered files of that source and table, now; otherwise
    they did not change (no one else touches them).
  * a late commit of a killed daemon's worker must not double a row either (it may be
    stale: only the daemon's next commit is held to the catalog again).
At the end every source reconciles and the table (a real scan) holds exactly the rows of
the registered files, each once.

Sizes (tests/tiers.py): 10 examples of up to 25 steps, the same every run, in the default
tier; 100 random ones of up to 40 steps in the full tier. QUIVERD_MODEL_EXAMPLES and
QUIVERD_MODEL_STEPS override both (explicit examples are random);
QUIVERD_MODEL_SHRINK=1 shrinks a failure to a short sequence (minutes).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections import defaultdict
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from pyiceberg.catalog.sql import SqlCatalog
from ulid import ULID

from quiverd.kernel.config import CatalogConfig, IcebergConfig
from quiverd.lake.compaction import compact
from quiverd.lake.iceberg import Projection, catalog_uri
from quiverd.lake.iceberg.catalog import file_id_of
from quiverd.lake.model import REGISTERED, FileRow, FileState
from quiverd.lake.tier import Tier
from quiverd_actors.projector import Projector
from tests.lake.catalogs import Log
from tests.lake.helpers import add_file, open_test_tier
from tests.lake.iceberg_model import Killed, LocalProjection, new_projector, snapshot_paths
from tests.tiers import size, tier

EXAMPLES = size(10, 100, env="QUIVERD_MODEL_EXAMPLES")
STEPS = size(25, 40, env="QUIVERD_MODEL_STEPS")
# The default tier replays the same examples every run; the full tier and an explicit
# QUIVERD_MODEL_EXAMPLES explore new ones.
DERANDOMIZE = "QUIVERD_MODEL_EXAMPLES" not in os.environ and tier() == "smoke"
HOUR0_NS = 1_795_000_000 * 1_000_000_000  # 2026-11-18, on an hour boundary
# Shrinking a failure costs minutes: on demand only (QUIVERD_MODEL_SHRINK=1).
PHASES = tuple(Phase) if os.environ.get("QUIVERD_MODEL_SHRINK") else (
    Phase.explicit, Phase.reuse, Phase.generate)
SOURCES = 2
CLIENTS = ("a", "b")

pytestmark = pytest.mark.timeout(600)


@dataclass
class Source:
    """One daemon: its tier (its source id), its projector, its worker's projection."""

    tier: Tier
    projection: LocalProjection
    projector: Projector
    zombie: LocalProjection | None = None  # a killed daemon's worker holding a commit
    segment: int = 0


@dataclass
class Model:
    rows_of: dict[str, frozenset[int]] = field(default_factory=dict)  # file id -> row ids
    next_row: int = 0
    # (table, source id) -> that source's files in the table after the last step
    files: dict[tuple[str, str], set[str]] = field(default_factory=lambda: defaultdict(set))
    seen_snapshots: set[int] = field(default_factory=set)


class ProjectionMachine(RuleBasedStateMachine):
    dsn: ClassVar[str] = ""  # "" = SQLite in the root; else a PostgreSQL database
    prefix: ClassVar[str] = ""  # client name prefix (PostgreSQL: the database outlives examples)

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="iceberg-model-"))
        self.loop = asyncio.Runner()
        self.stack = AsyncExitStack()
        self.sources: list[Source] = []
        self.model = Model()
        self.relaxed = False  # this step landed a dead daemon's commit
        self.clients = [f"{self.prefix}{c}" for c in CLIENTS]
        self.tables = [f"quiver.{c}" for c in self.clients]
        self.uri = catalog_uri(CatalogConfig(dsn=self.dsn), self.root)
        self.reader: SqlCatalog | None = None

    # ---- set-up ---------------------------------------------------------------------
    @initialize()
    def start(self) -> None:
        for i in range(SOURCES):
            tier = self.run(self.stack.enter_async_context(open_test_tier(
                self.root, dsn=self.dsn, node_id=f"n{i}", source_id=str(ULID()),
                iceberg=IcebergConfig(linger_ms=0))))
            projection = self._projection(tier)
            self.sources.append(Source(tier=tier, projection=projection,
                                       projector=new_projector(tier, projection)))
        self.reader = SqlCatalog("quiverd", uri=self.uri,
                                 warehouse=self.sources[0].tier.store.location(""))

    def teardown(self) -> None:
        try:
            if self.sources:
                self.settle()
                self._check_final()
        finally:
            for s in self.sources:
                for p in (s.projection, s.zombie):
                    if p is not None:
                        p.projection.close()
            if self.reader is not None:
                self.reader.engine.dispose()
            self.run(self.stack.aclose())
            self.loop.close()
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- rules -----------------------------------------------------------------------
    @rule(source=st.integers(0, SOURCES - 1), client=st.integers(0, len(CLIENTS) - 1),
          noticed=st.lists(st.booleans(), min_size=1, max_size=3))
    def register(self, source: int, client: int, noticed: list[bool]) -> None:
        """The uploader registers a file per entry of ``noticed`` (a rotation round);
        each notice reaches the projector unless the daemon died in between (then only a
        reconcile finds the file)."""
        s = self.sources[source]
        for told in noticed:
            rows = 1 + s.segment % 2
            ids = range(self.model.next_row, self.model.next_row + rows)
            self.model.next_row += rows
            s.segment += 1
            row = self.run(add_file(s.tier, pa.table({"id": pa.array(ids, pa.int64())}),
                                    client=self.clients[client], segment=s.segment,
                                    ts_ns=HOUR0_NS + s.segment * 1000))
            self.model.rows_of[row.file_id] = frozenset(ids)
            if told:
                s.projector.registered(row)

    @rule(source=st.integers(0, SOURCES - 1))
    def compact(self, source: int) -> None:
        """`quiverd compact` or the janitor's timer: small files of an hour -> one; the
        janitor then asks the projector to reconcile (``replaced``)."""
        s = self.sources[source]
        results = self.run(compact(s.tier, limiter=anyio.CapacityLimiter(1), log=Log()))
        for row in self._rows():
            if row.state is FileState.COMPACTED and row.compacted_into:
                into = self.model.rows_of.get(row.compacted_into, frozenset())
                self.model.rows_of[row.compacted_into] = into | self.model.rows_of[row.file_id]
        if any(r.outcome == "compacted" for r in results):
            s.projector.nudge()

    @rule(source=st.integers(0, SOURCES - 1), timer=st.booleans())
    def round(self, source: int, timer: bool) -> None:
        """One projector round (its lingering left out); ``timer``: the reconcile timer
        fired before it."""
        s = self.sources[source]
        if timer:
            s.projector.nudge()
        self.run(s.projector.round_once())

    @rule(source=st.integers(0, SOURCES - 1))
    def expire(self, source: int) -> None:
        """Expiry with no window at all: every snapshot but the current one may go."""
        s = self.sources[source]
        for table in self.tables:
            self.run(s.projection.expire(table, older_than_s=0.0))

    @rule(source=st.integers(0, SOURCES - 1), in_flight=st.booleans())
    def kill(self, source: int, in_flight: bool) -> None:
        """kill -9: the projector's memory is gone. ``in_flight``: it died while its
        worker held a commit (a reconcile's), which that worker may land later."""
        s = self.sources[source]
        old = s.projection
        if in_flight:
            old.freeze()
            s.projector.nudge()
            try:
                self.run(s.projector.round_once())
            except Killed:
                pass
        if old.captured is not None:
            if s.zombie is not None:
                s.zombie.projection.close()
            s.zombie = old
        else:
            old.projection.close()
        s.projection = self._projection(s.tier)
        s.projector = new_projector(s.tier, s.projection)

    @precondition(lambda self: any(s.zombie is not None for s in self.sources))
    @rule(data=st.data())
    def zombie_lands(self, data: st.DataObject) -> None:
        """The dead daemon's worker finishes the commit it held."""
        s = data.draw(st.sampled_from([s for s in self.sources if s.zombie is not None]))
        assert s.zombie is not None
        zombie, s.zombie = s.zombie, None
        try:
            zombie.land()
        finally:
            zombie.projection.close()
        self.relaxed = True

    def settle(self) -> None:
        """Every source reconciles."""
        for s in self.sources:
            s.projector.nudge()
            self.run(s.projector.round_once())

    # ---- the checks ------------------------------------------------------------------
    @invariant()
    def tables_hold_the_registered_files(self) -> None:
        if not self.sources:
            return
        relaxed, self.relaxed = self.relaxed, False
        rows = {r.file_id: r for r in self._rows()}
        for table, client in zip(self.tables, self.clients, strict=True):
            ids, new = self._current(table)
            assert len(ids) == len(set(ids)), f"{table}: a data file twice: {sorted(ids)}"
            unknown = [i for i in ids if i not in rows]
            assert not unknown, f"{table} holds files quiverd's catalog never had: {unknown}"
            held = [x for i in ids for x in self.model.rows_of[i]]
            doubled = sorted({x for x in held if held.count(x) > 1})
            assert not doubled, (f"{table}: rows {doubled} twice, files "
                                 f"{[(i, rows[i].state.value) for i in ids]}")
            committers = {snap.summary.additional_properties.get("quiverd.source-id")
                          for snap in new if snap.summary is not None}
            for s in self.sources:
                sid = s.tier.source_id
                mine = {i for i in ids if rows[i].source_id == sid}
                key = (table, sid)
                if sid in committers and not relaxed:
                    registered = {r.file_id for r in rows.values() if r.source_id == sid
                                  and r.client_name == client and r.state in REGISTERED}
                    assert mine == registered, (
                        f"{table} after a commit of source {sid}: holds "
                        f"{sorted(mine)}, the catalog registers {sorted(registered)}")
                elif sid not in committers:
                    assert mine == self.model.files[key], (
                        f"{table}: files of source {sid} changed with no commit of its own")
                self.model.files[key] = mine

    def _check_final(self) -> None:
        registered = [r for r in self._rows() if r.state in REGISTERED]
        for table, client in zip(self.tables, self.clients, strict=True):
            want = {r.file_id for r in registered if r.client_name == client}
            ids, _ = self._current(table)
            assert set(ids) == want and len(ids) == len(want), (table, sorted(ids), sorted(want))
            if not want:
                continue
            assert self.reader is not None
            tbl = self.reader.load_table(("quiver", client))
            got = sorted(tbl.scan(selected_fields=("id",)).to_arrow().column("id").to_pylist())
            assert got == sorted(x for i in want for x in self.model.rows_of[i])

    # ---- helpers ---------------------------------------------------------------------
    def run(self, coro: Any) -> Any:
        return self.loop.run(coro)

    def _projection(self, tier: Tier) -> LocalProjection:
        return LocalProjection(Projection(catalog_uri=self.uri, warehouse=tier.store.location(""),
                                          io_properties={}, cfg=IcebergConfig()))

    def _rows(self) -> list[FileRow]:
        mine = {s.tier.source_id for s in self.sources}
        rows = self.run(self.sources[0].tier.catalog.list_files())
        return [r for r in rows if r.source_id in mine]

    def _current(self, table: str) -> tuple[list[str], list[Any]]:
        """File ids of the current snapshot (duplicates kept) and the snapshots new since
        the last look."""
        assert self.reader is not None
        _, paths, snapshots = snapshot_paths(self.reader, table)
        new = [s for s in snapshots if s.snapshot_id not in self.model.seen_snapshots]
        self.model.seen_snapshots.update(s.snapshot_id for s in snapshots)
        return [file_id_of(p) for p in paths], new


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=STEPS, deadline=None,
                    database=None, derandomize=DERANDOMIZE,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                    print_blob=True, phases=PHASES)


def test_iceberg_projection_model_sqlite() -> None:
    run_state_machine_as_test(ProjectionMachine, settings=_settings(EXAMPLES))


def test_iceberg_projection_model_postgresql(pg_catalog_dsn: str) -> None:
    examples = max(1, EXAMPLES // 3)
    counter = iter(range(1_000_000))

    class OnPostgres(ProjectionMachine):
        dsn = pg_catalog_dsn

        def __init__(self) -> None:
            type(self).prefix = f"e{next(counter)}-"
            super().__init__()

    run_state_machine_as_test(OnPostgres, settings=_settings(examples))


def test_iceberg_compaction_of_a_noticed_file_before_its_round_is_no_double() -> None:
    """The sequence the model found on c112309 (shrunk by hand): a file registered while
    the daemon was down, one noticed, a compaction of both, then a round: the old
    projector reconciled (adding the compaction's output) and then appended the queued
    notice's file anyway, so row 1 was in the table twice."""
    m = ProjectionMachine()
    try:
        m.start()
        for step in (lambda: m.register(source=0, client=0, noticed=[False, True]),
                     lambda: m.compact(source=0),
                     lambda: m.round(source=0, timer=False)):
            step()
            m.tables_hold_the_registered_files()
        assert len(m._current("quiver.a")[0]) == 1
    finally:
        m.teardown()


def test_iceberg_model_catches_a_planted_bug() -> None:
    """The model must find a projection that never deletes a replaced file."""

    class NoRemovals(LocalProjection):
        def __getattr__(self, name: str) -> Any:
            call = super().__getattr__(name)
            if name != "sync":
                return call

            async def forgetful(table: str, want: Any, gone: Any, **kw: Any) -> Any:
                return await call(table, want, (), **kw)

            return forgetful

    class Planted(ProjectionMachine):
        def _projection(self, tier: Tier) -> LocalProjection:
            return NoRemovals(super()._projection(tier).projection)

    with pytest.raises(AssertionError):
        run_state_machine_as_test(Planted, settings=_settings(max(EXAMPLES, 20)))
