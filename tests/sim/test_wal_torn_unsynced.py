"""Crash states the crash-state tool found: torn unsynced WAL entries between sound ones.

``torn_unsynced_interior.pkl`` was recorded by a build without commit records: bundles
2 and 3 were written and not yet fdatasynced (never acked) when the power went; the disk
kept a later entry whole and tore 2 and 3. Replay skipped them, as it must, and then
reported sequences 2..3 lost, telling the operator that acknowledged data was gone when
none was. That WAL holds no commit record, so replay still cannot tell this from damage
to synced entries, and still reports it (the conservative answer for an old WAL).

``torn_unsynced_with_records.pkl`` is the same kind of crash state recorded by this
build (SPEC §3 commit records): replay calls the torn entries never acknowledged and
reports no loss. tests/wal/test_commit_records.py checks the rule byte by byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tests.sim.crashstates as crashstates

OLD_FORMAT = Path(__file__).parent / "regressions" / "torn_unsynced_interior.pkl"
WITH_RECORDS = Path(__file__).parent / "regressions" / "torn_unsynced_with_records.pkl"


def test_wal_torn_unsynced_entries_of_a_wal_with_records_are_not_reported_lost() -> None:
    report = crashstates.replay_saved(WITH_RECORDS)
    assert report.recovered > 0 and report.torn_unsynced > 0
    assert not report.violations, report.violations[0]


def test_wal_without_records_still_reports_them_and_loses_no_acked_bundle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(crashstates, "FALSE_LOSS_REPORTS_KNOWN", True)
    report = crashstates.replay_saved(OLD_FORMAT)
    assert report.recovered > 0
    assert not report.violations, report.violations[0]
    assert report.false_loss > 0  # what an old WAL cannot tell apart: counted, not failed
