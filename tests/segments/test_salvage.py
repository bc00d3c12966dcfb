"""segments.salvage: a segment rebuilt without the bundles that make the encoder raise."""

from __future__ import annotations

import errno

import pyarrow as pa
import pytest

from quiverd.kernel.bundle import Bundle, Slot, make_slot
from quiverd.segments.format import Piece, encode_segment
from quiverd.segments.open_segment import OpenSegment
from quiverd.segments.salvage import without_refused


class Source:
    def __init__(self, bundles: list[Bundle]) -> None:
        self.by_seq = {b.sequence: b for b in bundles}

    def read_slots(self, sequences: list[int]) -> dict[int, tuple[Slot, ...]]:
        return {s: self.by_seq[s].slots for s in sequences}

    def entry_bytes(self, sequences: list[int]) -> dict[int, bytes]:
        return {s: b"" for s in sequences}


def bundles() -> list[Bundle]:
    return [Bundle(client="c", slots=(make_slot(0, pa.table({"x": [seq]})),),
                   ingestion_ts_ns=1000 + seq, sequence=seq) for seq in range(1, 7)]


def encoder(alone: set[int], together: set[int], error: Exception) -> object:
    def encode(segment: OpenSegment) -> list[Piece]:
        held = {e.sequence for e in segment.entries}
        if held & alone or together <= held:
            raise error
        return encode_segment(segment, max_dictionary_cardinality=1024)
    return encode


def test_salvage_drops_bundles_that_fail_alone_and_those_that_fail_only_together() -> None:
    source = Source(bundles())
    segment = OpenSegment()
    for b in bundles():
        segment.add(b)
    kept, refused = without_refused(segment, source,
                                    encoder({5}, {2, 3}, ValueError("bad")))  # type: ignore[arg-type]
    assert sorted(refused) == [3, 5]
    assert "only with other bundles" in refused[3] and "ValueError: bad" in refused[5]
    assert [e.sequence for e in kept.entries] == [1, 2, 4, 6]


def test_salvage_lets_io_errors_through() -> None:
    segment = OpenSegment()
    for b in bundles():
        segment.add(b)
    with pytest.raises(OSError):
        without_refused(segment, Source(bundles()),
                        encoder({5}, set(), OSError(errno.EIO, "eio")))  # type: ignore[arg-type]
