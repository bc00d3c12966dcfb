"""Planted bugs the proof tools must catch: each one applied to a scratch copy of the tree.

    python -m tests.sim.mutations [NAME ...]      (scripts/mutations runs this)

For each mutation: copy the working tree (tracked and new files) to a scratch directory,
replace one snippet of product code (it must occur exactly once), run the tools named
for it from that copy, and expect them to FAIL. Each tool's verdict is printed; a
mutation that every one of its tools passes is a bug nothing would find: exit 1. The
product code itself is never changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CRASH_STATES = "tests/sim/test_crash_states.py"
CORE_MODEL = "tests/sim/test_core_model.py"
LAKE_CRASH_STATES = "tests/sim/test_lake_crash_states.py"
RETENTION_DROP_OLDEST = CORE_MODEL + "::test_retention_drop_oldest_model"
RETENTION_MAX_AGE = CORE_MODEL + "::test_retention_max_age_model"
RETENTION_BACKPRESSURE = CORE_MODEL + "::test_retention_backpressure_model"
ICEBERG_MODEL = "tests/lake/test_iceberg_model.py::test_iceberg_projection_model_sqlite"
DETSIM = "tests/sim/test_detsim.py::test_detsim_seeds_hold_every_invariant"
CORE_SIM = "tests/sim/test_detsim_core.py::test_detsim_core_seeds_hold_every_invariant"
UPLOADER_SIM = "tests/sim/test_uploader_sim.py::test_uploader_sim_seeds_hold_every_row_once"
NAMED_CUTS = ("tests/daemon/test_named_producers.py::"
              "test_named_producer_cut_between_fdatasync_and_ack_stores_each_bundle_once")
NAMED_KILL9 = ("tests/daemon/test_named_producers.py::"
               "test_named_producer_through_kill9_of_the_daemon_stores_each_bundle_once")
DAEMON_SIM = "tests/sim/test_detsim_daemon.py::test_detsim_daemon_seeds_hold_every_invariant"


@dataclass(frozen=True)
class Mutation:
    name: str
    why: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    more: tuple[tuple[str, str], ...] = ()  # further (old, new) replacements in ``path``


MUTATIONS = (
    Mutation(
        "ack_before_fdatasync",
        "the syncer hands a commit to the loop (which acks it) before its fdatasync",
        "actors/quiverd_actors/wal_threads.py",
        "            self.wal.sync()  # DurabilityLost ends the thread: nothing covered is acked\n",
        "            self.post(self.sink.on_durable, covered)\n"
        "            covered = []\n"
        "            self.wal.sync()  # DurabilityLost ends the thread: nothing covered is acked\n",
        (CRASH_STATES, CORE_MODEL, CORE_SIM, DAEMON_SIM)),
    Mutation(
        "segment_rename_without_dir_fsync",
        "a finalized segment is renamed into place and its directory never fsynced (nor the "
        "floor marker's beside it: its fsync would make the segment's rename durable too)",
        "quiverd/kernel/durable.py",
        "    fsync_dir(target.parent)\n    _step(hook, \"dir_fsynced\")\n",
        "    if target.parent.name != \"segments\":\n        fsync_dir(target.parent)\n"
        "    _step(hook, \"dir_fsynced\")\n",
        (CRASH_STATES, CORE_MODEL, CORE_SIM, DAEMON_SIM)),
    Mutation(
        "wal_release_before_segment_durable",
        "the finalizer releases the WAL before the segment holding its bundles is written",
        "actors/quiverd_actors/finalizer.py",
        "            size = await _until_written(job, limiter, retry, stats)\n",
        "            assert segment.last_sequence is not None\n"
        "            await releases.send(WalReleased(upto_sequence=segment.last_sequence))\n"
        "            size = await _until_written(job, limiter, retry, stats)\n",
        (CRASH_STATES, CORE_MODEL, CORE_SIM)),
    Mutation(
        "acklog_append_not_synced",
        "ack.log records are appended and relied on (gc, replies) without their fdatasync",
        "actors/quiverd_actors/ack_logger.py",
        "    file.append(encoded)\n    file.sync()\n",
        "    file.append(encoded)\n",
        (CRASH_STATES, CORE_MODEL, CORE_SIM, DAEMON_SIM)),
    Mutation(
        "retention_drops_without_outcomes",
        "retention deletes segments the subscriber has not acked without writing their "
        "dropped outcomes first",
        "actors/quiverd_actors/ack_logger.py",
        "                records += plan.records\n",
        "                records += ()\n",
        (CRASH_STATES, RETENTION_DROP_OLDEST, RETENTION_MAX_AGE)),
    Mutation(
        "retention_drops_under_backpressure",
        "the size cap deletes the oldest segments under the backpressure policy too",
        "actors/quiverd_actors/gc_sweeper.py",
        "        if self.cfg.size_cap_policy == \"drop_oldest\":\n",
        "        if self.cfg.size_cap_bytes:\n",
        (RETENTION_BACKPRESSURE,)),
    Mutation(
        "compaction_inputs_readded",
        "a sync never deletes the files a compaction replaced: the table holds both",
        "quiverd/lake/iceberg/projection.py",
        "                deleted = (cat.data_files_in(tbl, set(doomed.values()), set(doomed))\n",
        "                deleted = [] and (cat.data_files_in(tbl, set(doomed.values()), "
        "set(doomed))\n",
        (ICEBERG_MODEL, DETSIM, LAKE_CRASH_STATES)),
    Mutation(
        "compaction_leaves_inputs_registered",
        "a compaction's replace names the output in its inputs' rows but leaves them "
        "registered: the inputs and the output both count, the rows twice",
        "quiverd/lake/catalog/sql.py",
        "    return (f\"UPDATE files SET state = '{FileState.COMPACTED.value}', "
        "compacted_into = ?, \"\n",
        "    return (f\"UPDATE files SET compacted_into = ?, \"\n",
        (LAKE_CRASH_STATES, DETSIM, DAEMON_SIM)),
    Mutation(
        "expiry_of_the_current_snapshot",
        "expiry no longer protects the snapshot main points at",
        "quiverd/lake/iceberg/catalog.py",
        "if s.snapshot_id not in protected and ended.get(s.snapshot_id, cutoff_ms) < cutoff_ms]",
        "if ended.get(s.snapshot_id, 0) < cutoff_ms]",
        (ICEBERG_MODEL, DETSIM)),
    Mutation(
        "lake_ack_before_register",
        "the uploader acks a file's bundles once it is sealed, before upload and registration",
        "actors/quiverd_actors/uploader/actor.py",
        "                row = await self.publisher.publish(sealed)\n",
        "                await self._settle(sealed.file, ackfmt.ACK)\n"
        "                row = await self.publisher.publish(sealed)\n",
        (LAKE_CRASH_STATES, DETSIM, UPLOADER_SIM, DAEMON_SIM)),
    Mutation(
        "uploader_readds_pieces_in_flight",
        "a bundle delivered again while a file in flight holds one of its slots adds that "
        "slot again (the defect found as more rows than sent under a full staging disk)",
        "actors/quiverd_actors/uploader/actor.py",
        "        if held:  # redelivered while files in flight hold some of its pieces\n",
        "        if False:  # redelivered while files in flight hold some of its pieces\n",
        (UPLOADER_SIM,)),
    Mutation(
        "staged_file_published_incomplete",
        "a staged file (a job's rows written while it was undecided) is published once any "
        "of its bundles came published, not all of them",
        "actors/quiverd_actors/uploader/staged.py",
        "    return f.matched is not None and len(f.matched) == len(f.bundles)\n",
        "    return bool(f.matched)\n",
        (UPLOADER_SIM,)),
    Mutation(
        "producer_resends_stored_again",
        "the WAL writer stores a named producer's resent bundle again",
        "actors/quiverd_actors/wal_writer.py",
        "            if any(req.bundle.producer is not None for req in batch):\n",
        "            if False:\n",
        (NAMED_CUTS, NAMED_KILL9)),
    Mutation(
        "producer_numbers_not_saved_before_release",
        "the WAL is released without writing producers.json first",
        "actors/quiverd_actors/wal_writer.py",
        "                await self._save_producers(limiter)\n",
        "                pass\n",
        (CRASH_STATES,)),
    Mutation(
        "producer_numbers_not_replayed",
        "a start forgets the numbers of the bundles the WAL still holds (producers.json only)",
        "quiverd/runtime/recovery.py",
        "            if s.slot == META_SLOT and s.fingerprint == PRODUCER_META_FINGERPRINT:\n",
        "            if False:\n",
        (NAMED_KILL9, CRASH_STATES)),
    Mutation(
        "janitor_deletes_registered_objects",
        "the janitor counts registered files' objects as orphans and its catalog recheck "
        "before each delete says yes (either guard alone keeps them: as first planted, "
        "without the recheck's half, no tool caught it and none could)",
        "quiverd/lake/janitor.py",
        "    if row.state in UNFINISHED or row.state in REGISTERED or row.state in RESTORABLE:\n",
        "    if row.state in UNFINISHED or row.state in RESTORABLE:\n",
        (LAKE_CRASH_STATES,),  # the simulation's janitor grace is a day: no sweep deletes
        more=(("        return row is None or (row.state is FileState.ABANDONED) or (\n",
               "        return True or row is None or (\n"
               "            row.state is FileState.ABANDONED) or (\n"),)),
)


def copy_tree(dest: Path) -> None:
    """The working tree as it is (tracked files and new ones), without .git or the venv."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def apply(m: Mutation, tree: Path) -> None:
    path = tree / m.path
    text = path.read_text()
    for old, new in ((m.old, m.new), *m.more):
        if text.count(old) != 1:
            raise SystemExit(f"mutation {m.name}: the snippet occurs {text.count(old)} times "
                             f"in {m.path} (must be once): the code moved; update tests/sim/"
                             "mutations.py")
        text = text.replace(old, new)
    path.write_text(text)


def run(m: Mutation, test: str, tree: Path) -> tuple[int, str, float]:
    """Run ``test`` on the copy; (pytest's exit code, last lines, seconds)."""
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'actors'}", **m.env}
    env.pop("PYTEST_XDIST_WORKER", None)
    started = time.monotonic()
    proc = subprocess.run(
        [str(REPO / ".venv/bin/python"), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
         "-n", "0", test], cwd=tree, env=env, capture_output=True, text=True)
    tail = "\n".join(proc.stdout.splitlines()[-6:])
    return proc.returncode, tail, time.monotonic() - started


def check_isolated(tree: Path) -> None:
    """The copy's code, not the checkout's, is what runs (an editable install must not win)."""
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'actors'}"}
    out = subprocess.run([str(REPO / ".venv/bin/python"), "-c",
                          "import quiverd, quiverd_actors; print(quiverd.__file__); "
                          "print(quiverd_actors.__file__)"],
                         cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    for line in out.split():
        if not line.startswith(str(tree)):
            raise SystemExit(f"the mutated copy imports {line}, not its own code")


def main(names: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    unknown = set(names) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"unknown mutations {sorted(unknown)}; known: {[m.name for m in MUTATIONS]}")
        return 2
    with tempfile.TemporaryDirectory(prefix="qmut") as scratch:
        tree = Path(scratch)
        copy_tree(tree)
        for test in sorted({t for m in chosen for t in m.tests}):
            code, tail, _ = run(Mutation("none", "", "", "", "", ()), test, tree)
            if code != 0:  # a tool that fails on the product itself would "catch" anything
                print(f"{test} fails without a mutation: fix it first\n{tail}")
                return 2
    missed = 0
    for m in chosen:
        caught_by = 0
        with tempfile.TemporaryDirectory(prefix="qmut") as scratch:
            tree = Path(scratch)
            copy_tree(tree)
            apply(m, tree)
            check_isolated(tree)
            for test in m.tests:
                code, tail, seconds = run(m, test, tree)
                caught = code == 1  # tests failed (not a collection or usage error)
                verdict = "caught" if caught else "MISSED"
                print(f"{m.name:40} {test:40} {verdict} in {seconds:.0f} s")
                caught_by += caught
                if not caught:
                    print(f"  ({m.why})\n" + "\n".join(f"  | {t}" for t in tail.splitlines()))
        if not caught_by:
            missed += 1
            print(f"{m.name}: NO TOOL CAUGHT IT")
    print(f"{len(chosen)} mutations, {missed} caught by no tool")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
