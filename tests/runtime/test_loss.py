"""find_loss: which sequences and gone segments no file holds, from sequence ranges alone."""

from __future__ import annotations

from types import SimpleNamespace

from quiverd.runtime.loss import Coverage, LostSegment, find_loss


def seg(segment_seq: int, first: int, last: int) -> SimpleNamespace:
    return SimpleNamespace(segment_seq=segment_seq, first_sequence=first, last_sequence=last)


def test_loss_none_when_marker_segments_and_wal_hold_every_sequence() -> None:
    loss = find_loss(segments=[seg(3, 5, 10), seg(4, 11, 20)], deleted_sequence=4,
                     wal_sequences=range(18, 26), gone={})
    assert not loss and loss.sequences == [] and loss.highest_sequence == 25


def test_loss_gap_between_segments_is_the_gone_segment_between_them() -> None:
    loss = find_loss(segments=[seg(1, 1, 10), seg(3, 21, 30)], deleted_sequence=0,
                     wal_sequences=[], gone={2: 10})
    assert loss.sequences == [(11, 20)] and loss.count == 10
    assert loss.segments == [LostSegment(segment_seq=2, bundle_count=10)]


def test_loss_newest_segment_gone_and_released_counts_from_ack_log() -> None:
    loss = find_loss(segments=[seg(1, 1, 4)], deleted_sequence=0, wal_sequences=[],
                     gone={2: 7})
    assert loss.sequences == [(5, 11)] and loss.highest_sequence == 11
    assert loss.segments == [LostSegment(segment_seq=2, bundle_count=7)]


def test_loss_none_when_wal_still_holds_the_gone_segments_bundles() -> None:
    loss = find_loss(segments=[seg(1, 1, 4)], deleted_sequence=0, wal_sequences=range(5, 14),
                     gone={2: 7})
    assert not loss and loss.highest_sequence == 13


def test_loss_attributed_to_the_oldest_gone_segments_the_wal_released() -> None:
    # Segments 2 (sequences 5..7) and 3 (8..11) are gone; the WAL still holds 8..11.
    loss = find_loss(segments=[seg(1, 1, 4)], deleted_sequence=0, wal_sequences=range(8, 12),
                     gone={2: 3, 3: 4})
    assert loss.sequences == [(5, 7)]
    assert loss.segments == [LostSegment(segment_seq=2, bundle_count=3)]


def test_loss_skipped_wal_entry_is_lost_without_a_segment() -> None:
    loss = find_loss(segments=[seg(1, 1, 3)], deleted_sequence=0,
                     wal_sequences=[4, 5, 7, 8], gone={})
    assert loss.sequences == [(6, 6)] and loss.segments == []


def test_loss_gone_segment_ack_log_never_recorded_is_reported_without_count() -> None:
    loss = find_loss(segments=[seg(1, 1, 4)], deleted_sequence=0, wal_sequences=[],
                     gone={2: None})
    assert loss.sequences == [] and loss.segments == [LostSegment(segment_seq=2,
                                                                  bundle_count=None)]
    held = find_loss(segments=[seg(1, 1, 4)], deleted_sequence=0, wal_sequences=[5, 6],
                     gone={2: None})
    assert not held


def test_loss_none_below_the_deleted_marker() -> None:
    loss = find_loss(segments=[], deleted_sequence=40, wal_sequences=[41, 42], gone={})
    assert not loss and loss.highest_sequence == 42


def test_coverage_holds_and_unheld_ranges() -> None:
    cov = Coverage([seg(2, 11, 20), seg(1, 5, 8)], deleted_sequence=3)
    assert cov.high == 20
    assert [s for s in range(1, 23) if cov.holds(s)] == [1, 2, 3, 5, 6, 7, 8, *range(11, 21)]
    assert cov.unheld(1, 25) == [(4, 4), (9, 10), (21, 25)]
    assert cov.unheld(12, 15) == [] and Coverage([], 0).unheld(2, 3) == [(2, 3)]
