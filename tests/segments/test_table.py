"""The segment table (quiverd.segments.table): one owner, read-only views, a kept byte total."""

from __future__ import annotations

from pathlib import Path

from quiverd.segments.table import SegmentInfo, SegmentTable


def info(seq: int, size: int) -> SegmentInfo:
    return SegmentInfo(segment_seq=seq, path=Path(f"/s/{seq}"), size_bytes=size,
                       bundle_count=1, first_sequence=seq, last_sequence=seq,
                       min_ts_ns=0, max_ts_ns=0)


def test_table_views_see_changes_and_the_byte_total_follows() -> None:
    table = SegmentTable([info(2, 20), info(1, 10)])
    view = table.view()
    assert (view.total_bytes(), view.seqs(), [s.segment_seq for s in view]) == (30, [1, 2], [1, 2])
    table.add(info(3, 5))
    table.add(info(3, 7))  # replaced, not counted twice
    assert (view.total_bytes(), len(view), view.bytes_from(2)) == (37, 3, 27)
    assert table.remove(1) == info(1, 10) and table.remove(1) is None
    assert (view.total_bytes(), 1 in view, view.get(3)) == (27, False, info(3, 7))
    assert not hasattr(view, "add") and not hasattr(view, "remove")
