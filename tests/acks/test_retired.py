"""retired.json (quiverd.acks.retired): byte-exact layout, bound, damage refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from quiverd.acks import retired
from quiverd.acks.retired import MAX_MARKS, RetiredMark, RetiredMarks


def mark(name: str, at_ns: int = 1_764_763_200_000_000_000, reason: str = "lag_bytes"
         ) -> RetiredMark:
    return RetiredMark(name=name, reason=reason, lag_bytes=3_637_320, idle_s=61.25,
                       retired_at_ns=at_ns)


def test_retired_file_encoding_is_byte_exact_and_round_trips(tmp_path: Path) -> None:
    marks = RetiredMarks(tmp_path / "retired.json")
    marks.add(mark("exp-1"))
    assert marks.encode() == (
        b'{"version":1,"retired":[{"name":"exp-1","reason":"lag_bytes",'
        b'"lag_bytes":3637320,"idle_s":61.25,"retired_at_ns":1764763200000000000}]}\n')
    marks.save()
    again = retired.load(tmp_path / "retired.json")
    assert list(again) == [mark("exp-1")]
    assert not (tmp_path / "retired.json.tmp").exists()


def test_retired_file_absent_reads_as_no_marks(tmp_path: Path) -> None:
    assert len(retired.load(tmp_path / "retired.json")) == 0


@pytest.mark.parametrize("data", [b"", b"{", b'{"version":2,"retired":[]}',
                                  b'{"version":1,"retired":[{"name":"x"}]}',
                                  b'{"version":1,"retired":[],"extra":1}'])
def test_retired_file_damaged_or_newer_is_refused(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "retired.json"
    path.write_bytes(data)
    with pytest.raises(ValueError):
        retired.load(path)


def test_retired_marks_are_bounded_oldest_first_out(tmp_path: Path) -> None:
    marks = RetiredMarks(tmp_path / "retired.json")
    for i in range(MAX_MARKS + 5):
        marks.add(mark(f"s{i}", at_ns=i))
    assert len(marks) == MAX_MARKS
    assert marks.get("s4") is None and marks.get("s5") is not None
    assert [m.name for m in marks][-1] == f"s{MAX_MARKS + 4}"


def test_retired_mark_text_names_the_reason_and_the_way_back() -> None:
    text = mark("exp-1").text()
    assert text.startswith("subscriber 'exp-1' was retired at 2025-12-03T12:00:00Z: its lag "
                           "reached 3637320 bytes with no consumer connected")
    assert "`quiverd subscribers add exp-1`" in text
    idle = mark("exp-2", reason="idle").text()
    assert "it had no consumer for 61 s while lagging (3637320 bytes)" in idle
