"""Quarantine, restore, forget and the janitor against a model, on the real parts (fs
store, SQLite catalog, lake files written as the uploader writes them): interleavings of
damage in the store, scrub passes, an operator putting a backup (or a wrong copy) at a
file's key, `files restore` with and without `--from`, `files forget`, and janitor sweeps
a day later.

Checked after EVERY step, per file:
  * its catalog state is the model's (registered, Quarantined, Lost), and its bundles
    count as covered exactly while it is registered;
  * what its key holds is the model's: the file's bytes, damaged bytes, or nothing; so
    no sweep ever deleted an object a live, quarantined or lost row names;
  * every damaged object the scrub found is kept under quarantine/;
  * a command's answer (done, refused as corrupt, refused as missing, state conflict)
    is the one the model predicts, and a refused command changed nothing.

Sizes (tests/tiers.py): 6 examples of up to 25 steps by default, 30 of up to 40 in the
full tier; QUIVERD_MODEL_EXAMPLES and QUIVERD_MODEL_STEPS override both.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from ulid import ULID

from quiverd.kernel.errors import LakeFileCorrupt, LakeFileMissing
from quiverd.lake.catalog import StateConflict
from quiverd.lake.janitor import sweep
from quiverd.lake.model import REGISTERED, FileRow
from quiverd.lake.restore import forget_file, restore_file
from quiverd.lake.scrub import QUARANTINE_PREFIX, scrub_pass
from quiverd.lake.tier import Tier
from tests.lake.helpers import NS, add_file, open_test_tier
from tests.lake.test_scrub import damaged, floats
from tests.tiers import size, tier

EXAMPLES = size(6, 30, env="QUIVERD_MODEL_EXAMPLES")
STEPS = size(25, 40, env="QUIVERD_MODEL_STEPS")
DERANDOMIZE = "QUIVERD_MODEL_EXAMPLES" not in os.environ and tier() == "smoke"
FILES = 3
GOOD, BAD, NONE = "good", "damaged", "none"  # what a file's key holds
LIVE, QUARANTINED, LOST = "registered", "Quarantined", "Lost"

pytestmark = pytest.mark.timeout(600)


@dataclass
class File:
    row: FileRow
    good: bytes
    backup: Path
    state: str = LIVE
    key: str = GOOD
    quarantined_copy: bool = False  # the damaged bytes are under quarantine/


class QuarantineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="quarantine-model-"))
        self.loop = asyncio.Runner()
        self.stack = AsyncExitStack()
        self.files: list[File] = []
        self.tier: Tier | None = None

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run(coro)

    @initialize()
    def start(self) -> None:
        self.tier = self.run(self.stack.enter_async_context(open_test_tier(
            self.root / "d", source_id=str(ULID()))))
        for i in range(FILES):
            row = self.run(add_file(self.tier, floats(i), segment=i + 1, keep_local=False))
            good = self.run(self.tier.store.read(row.object_key))
            backup = self.root / f"backup-{i}.parquet"
            backup.write_bytes(good)
            self.files.append(File(row=row, good=good, backup=backup))

    def teardown(self) -> None:
        try:
            self.run(self.stack.aclose())
        finally:
            self.loop.close()
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- the store, as a failing disk or an operator changes it -----------------------
    def _put(self, f: File, data: bytes) -> None:
        assert self.tier is not None
        path = self.tier.data.objects / f.row.object_key
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.chmod(0o640)
        path.write_bytes(data)

    @rule(i=st.integers(0, FILES - 1))
    def damage(self, i: int) -> None:
        """Bit rot, or a tool writing over the object, wherever it is."""
        f = self.files[i]
        if f.key == NONE:
            return
        self._put(f, damaged(f.good))
        f.key = BAD

    @rule(i=st.integers(0, FILES - 1), right=st.booleans())
    def operator_puts_a_copy(self, i: int, right: bool) -> None:
        """The backup (or a wrong copy) put at a file's empty key by hand."""
        f = self.files[i]
        if f.key != NONE:
            return
        self._put(f, f.good if right else damaged(f.good))
        f.key = GOOD if right else BAD

    # ---- quiverd --------------------------------------------------------------------
    @rule()
    def scrub(self) -> None:
        assert self.tier is not None
        report = self.run(scrub_pass(self.tier, rate_bytes_per_s=1e9))
        assert not report.failures, report.failures
        found = []
        for f in self.files:
            if f.state == LIVE and f.key == BAD:
                f.state, f.key, f.quarantined_copy = QUARANTINED, NONE, True
                found.append(f.row.file_id)
            elif f.state == QUARANTINED and f.key == BAD:
                # A damaged object at a quarantined key: moved away as a cut quarantine.
                f.key, f.quarantined_copy = NONE, True
        assert sorted(c.file_id for c in report.corrupt) == sorted(found)

    @rule()
    def sweep_a_day_later(self) -> None:
        assert self.tier is not None
        later = time.time_ns() + 2 * self.tier.cfg.lake.janitor.grace_s * NS
        report = self.run(sweep(self.tier, now_ns=later))
        assert report.orphan_objects == [] and not report.failures

    @rule(i=st.integers(0, FILES - 1), from_backup=st.booleans())
    def restore(self, i: int, from_backup: bool) -> None:
        assert self.tier is not None
        f = self.files[i]
        source = f.backup if from_backup else None
        if f.key == BAD:
            expect: type[Exception] | None = LakeFileCorrupt
        elif f.key == NONE and not from_backup:
            expect = LakeFileMissing
        else:
            expect = None
        try:
            done = self.run(restore_file(self.tier, f.row.file_id, source))
        except (LakeFileCorrupt, LakeFileMissing) as exc:
            assert expect is not None and isinstance(exc, expect), (exc, f)
            return
        assert expect is None, (f, done)
        assert done.changed == (f.state != LIVE or f.key == NONE)
        f.state, f.key = LIVE, GOOD

    @rule(i=st.integers(0, FILES - 1))
    def forget(self, i: int) -> None:
        assert self.tier is not None
        f = self.files[i]
        try:
            _, moved = self.run(forget_file(self.tier, f.row.file_id))
        except StateConflict:
            assert f.state == LIVE
            return
        assert f.state in (QUARANTINED, LOST) and moved == (f.state == QUARANTINED)
        f.state = LOST

    # ---- what must hold after every step ----------------------------------------------
    @invariant()
    def catalog_and_store_match_the_model(self) -> None:
        if self.tier is None:
            return
        tier = self.tier
        for f in self.files:
            row = self.run(tier.catalog.get(f.row.file_id))
            assert row is not None
            state = LIVE if row.state in REGISTERED else row.state.value
            assert state == f.state, (row.state, f)
            covered = self.run(tier.catalog.covered(tier.source_id, 0, f.row.first_segment))
            assert covered == ({0: {0}} if f.state == LIVE else {}), (covered, f)
            path = tier.data.objects / f.row.object_key
            held = NONE if not path.exists() else GOOD if path.read_bytes() == f.good else BAD
            assert held == f.key, (held, f)
            kept = tier.data.objects / (QUARANTINE_PREFIX + f.row.object_key)
            if f.quarantined_copy:
                assert kept.read_bytes() == damaged(f.good)


def test_quarantine_restore_forget_and_janitor_against_a_model() -> None:
    run_state_machine_as_test(QuarantineMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
        derandomize=DERANDOMIZE,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
        suppress_health_check=list(HealthCheck)))
