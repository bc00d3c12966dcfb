"""Inclusive integer ranges ``(lo, hi)`` (WAL sequences): merge and complement. Pure."""

from __future__ import annotations

from collections.abc import Iterable

Ranges = list[tuple[int, int]]


def merge(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Overlapping or adjacent inclusive ranges joined, ascending."""
    merged: Ranges = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def complement(merged: Ranges, first: int, last: int) -> Ranges:
    """The parts of ``first..last`` no range of ``merged`` (ascending, disjoint) covers."""
    out: Ranges = []
    at = first
    for lo, hi in merged:
        if hi < at:
            continue
        if lo > last:
            break
        if lo > at:
            out.append((at, lo - 1))
        at = max(at, hi + 1)
    if at <= last:
        out.append((at, last))
    return out
