"""Staged files: a Spark job's rows become Parquet while its tasks still write (SPEC §7).

    dispatcher ──LocalDelivery(staged=True)──▶ uploader ──▶ staged file per (shard,
        (a bundle of an undecided job, once)                client, slot, column, hour,
                                                            job, partition, attempt)
    dispatcher ──LocalDelivery (published)──▶ uploader: each piece a staged file holds is
        matched, not added again; a file whose every bundle is matched is rotated
        (reason ``staged``) and published like any other

A staged file is only a head start: it is registered (and its bundles acked) through
the same path as every file, only once each bundle it holds was delivered published,
so what the catalog holds is the same as without it. Anything that keeps a staged file
from completing leaves the work to the usual path: a piece not previewed (the preview
was skipped, or its job was decided first) goes into an ordinary file; a file whose
attempt lost, or whose job was aborted or expired, is abandoned unmatched; one left with
some bundles matched and the rest never coming (retention dropped them, a bundle
isolated after a failure) is abandoned and its matched bundles nacked, to come back and
take the usual path. A daemon that restarts abandons its staged files with every other
unfinished one (``Tier.recover``).

This module keeps the bookkeeping (which file holds which piece, which may still take
rows, what to do with each on a tick); the uploader does the I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from quiverd.kernel.jobs import JobDecision
from quiverd.lake.partitions import Hour
from quiverd_actors.uploader.files import FileKey, OpenFile

# (shard, segment_seq, bundle_index, slot, hour): one piece of one bundle
PieceKey = tuple[int, int, int, int, Hour]
Attempt = tuple[str, int, int]  # (job_id, partition, attempt)

MAX_STAGED_FILES = 64  # staged files at once; more attempts take the usual path
STALLED_S = 10.0  # a partly matched file with no match for this long is given up
UNCLAIMED_S = 60.0  # a winner's file none of whose bundles came this long after the commit

Fate = Literal["keep", "lost", "stalled", "unclaimed"]


@dataclass
class StagedFiles:
    """Every staged file, the pieces each holds, and the ones still taking rows."""

    open: dict[tuple[FileKey, Attempt], OpenFile] = field(default_factory=dict)
    every: set[OpenFile] = field(default_factory=set)
    pieces: dict[PieceKey, OpenFile] = field(default_factory=dict)

    def room(self) -> bool:
        return len(self.every) < MAX_STAGED_FILES

    def holds(self, piece: PieceKey) -> bool:
        return piece in self.pieces

    def add(self, f: OpenFile, piece: PieceKey) -> None:
        self.every.add(f)
        self.pieces[piece] = f

    def take(self, piece: PieceKey) -> OpenFile | None:
        """The live staged file holding ``piece`` (delivered published now), if any."""
        f = self.pieces.pop(piece, None)
        if f is None or f.failed or f.matched is None:
            return None
        return f

    def full(self, f: OpenFile) -> None:
        """``f`` takes no more rows (its size, a schema it cannot take, or it completed);
        it still waits for its bundles to be matched."""
        assert f.attempt is not None
        key = (f.key, f.attempt)
        if self.open.get(key) is f:
            del self.open[key]

    def forget(self, f: OpenFile) -> None:
        """``f`` is out: published, or abandoned."""
        self.full(f)
        self.every.discard(f)
        shard, slot, hour = f.shard, f.slot, f.hour
        for seg, idx in f.bundles:
            piece = (shard, seg, idx, slot, hour)
            if self.pieces.get(piece) is f:
                del self.pieces[piece]

    def of_job(self, job_id: str) -> Iterator[OpenFile]:
        return (f for f in list(self.every) if f.attempt is not None and f.attempt[0] == job_id)

    def fates(self, now: float, decided: Callable[[str], JobDecision | None] | None
              ) -> list[tuple[OpenFile, Fate]]:
        """What a tick does with each staged file not yet complete."""
        out: list[tuple[OpenFile, Fate]] = []
        for f in list(self.every):
            fate = fate_of(f, now, decided)
            if fate != "keep":
                out.append((f, fate))
        return out


def complete(f: OpenFile) -> bool:
    """Is every bundle ``f`` holds delivered published (matched)?"""
    return f.matched is not None and len(f.matched) == len(f.bundles)


def fate_of(f: OpenFile, now: float, decided: Callable[[str], JobDecision | None] | None
            ) -> Fate:
    """Keep ``f``, or give it up: ``lost`` (its attempt will never be published),
    ``stalled`` (partly matched, the rest not coming), ``unclaimed`` (a winner none of
    whose bundles came)."""
    assert f.attempt is not None and f.matched is not None
    if f.matched:
        return "stalled" if now - f.matched_at > STALLED_S else "keep"
    decision = decided(f.attempt[0]) if decided is not None else None
    if decision is None:
        return "keep"  # undecided: its job's writer leases bound how long
    winner = decision.winner(f.attempt[1])
    if winner is None or winner.attempt != f.attempt[2]:
        return "lost"
    if not f.decided_at:
        f.decided_at = now
    return "unclaimed" if now - f.decided_at > UNCLAIMED_S else "keep"


__all__ = ["MAX_STAGED_FILES", "STALLED_S", "UNCLAIMED_S", "Attempt", "Fate", "PieceKey",
           "StagedFiles", "complete", "fate_of"]
