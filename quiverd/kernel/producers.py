"""Idempotent producer sessions (SPEC §3 "Producer positions", docs/protocol.md v3): which
numbered bundles of each producer stream a shard holds, so that a resent bundle is
answered with its first ACK instead of being stored twice.

A producer that names itself in HELLO (``producer_id`` and an ``incarnation``: a random
64-bit number the client picks once per process) numbers its bundles per client name
from 1 (``producer_seq``). A *stream* is (producer_id, incarnation, client); all of a
stream's bundles go to one shard (the client name picks it). Per stream the shard keeps:

    top      the highest producer_seq stored
    missing  the numbers below ``top`` never stored (refused, or still on their way);
             at most MAX_MISSING, the oldest forgotten first (then taken as stored:
             a client resends only its last ``max_inflight`` bundles)
    recent   producer_seq -> the WAL sequence of its entry, the last RECENT_KEPT kept
             (a resend's ACK names the first one's sequence; an older one's names 0)
    last_ns  when it last stored a bundle; a stream idle for ``retain_s`` is forgotten

Only bundles whose covering fdatasync returned are in the table (the WAL writer adds
them as it acks them), so nothing in it can be lost by a crash. It is kept durable in
``shard-<n>/producers.json`` (tmp → fsync → rename → fsync dir), written before each
release of the WAL; at a start it is read back and the WAL's surviving entries, whose
metadata slot carries each bundle's stream and number, are added to it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

FILE_VERSION = 1
MAX_MISSING = 4096  # numbers below top never stored, kept per stream
RECENT_KEPT = 1024  # producer_seq -> sequence, in memory per stream
RECENT_SAVED = 64  # of those, written to producers.json
DEFAULT_RETAIN_S = 7 * 86_400  # as long as Kafka keeps an idle producer's id


class ProducerTag(msgspec.Struct, frozen=True, kw_only=True):
    """Which stream a bundle belongs to, and its number in it."""

    producer: str
    incarnation: int
    seq: int


StreamKey = tuple[str, int, str]  # (producer_id, incarnation, client)


def stream_of(client: str, tag: ProducerTag) -> StreamKey:
    return (tag.producer, tag.incarnation, client)


@dataclass
class StreamState:
    top: int = 0
    missing: set[int] = field(default_factory=set)
    recent: OrderedDict[int, int] = field(default_factory=OrderedDict)
    last_ns: int = 0

    def holds(self, seq: int) -> bool:
        return seq <= self.top and seq not in self.missing

    def add(self, seq: int, sequence: int, now_ns: int) -> None:
        if seq > self.top:
            gap = range(max(self.top + 1, seq - MAX_MISSING), seq)
            self.missing.update(gap)
            self.top = seq
            if len(self.missing) > MAX_MISSING:
                for old in sorted(self.missing)[:len(self.missing) - MAX_MISSING]:
                    self.missing.discard(old)
        else:
            self.missing.discard(seq)
        self.recent[seq] = sequence
        self.recent.move_to_end(seq)
        while len(self.recent) > RECENT_KEPT:
            self.recent.popitem(last=False)
        self.last_ns = max(self.last_ns, now_ns)


class _SavedStream(msgspec.Struct, kw_only=True):
    producer: str
    incarnation: int
    client: str
    top: int
    missing: list[int]
    recent: list[tuple[int, int]]
    last_ns: int


class _Saved(msgspec.Struct, kw_only=True):
    version: int
    streams: list[_SavedStream]


class ProducerTable:
    """One shard's producer streams (event loop only; ``encode`` copies what it saves)."""

    def __init__(self, retain_s: float = DEFAULT_RETAIN_S) -> None:
        self.retain_s = retain_s
        self.streams: dict[StreamKey, StreamState] = {}
        self.changed = False  # since the last encode

    def sequence_of(self, key: StreamKey, seq: int) -> int | None:
        """The WAL sequence a stored bundle was acked with (0 when no longer known);
        None when the stream does not hold ``seq``."""
        state = self.streams.get(key)
        if state is None or not state.holds(seq):
            return None
        return state.recent.get(seq, 0)

    def add(self, key: StreamKey, seq: int, sequence: int, now_ns: int | None = None) -> None:
        state = self.streams.get(key)
        if state is None:
            state = self.streams[key] = StreamState()
        state.add(seq, sequence, time.time_ns() if now_ns is None else now_ns)
        self.changed = True

    def expire(self, now_ns: int | None = None) -> int:
        """Forget streams idle for ``retain_s``; how many."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        cutoff = now_ns - int(self.retain_s * 1e9)
        old = [k for k, s in self.streams.items() if s.last_ns < cutoff]
        for k in old:
            del self.streams[k]
        if old:
            self.changed = True
        return len(old)

    def encode(self) -> bytes:
        self.changed = False
        return msgspec.json.encode(_Saved(version=FILE_VERSION, streams=[
            _SavedStream(producer=k[0], incarnation=k[1], client=k[2], top=s.top,
                         missing=sorted(s.missing),
                         recent=list(s.recent.items())[-RECENT_SAVED:], last_ns=s.last_ns)
            for k, s in sorted(self.streams.items())]))

    @classmethod
    def decode(cls, raw: bytes, retain_s: float = DEFAULT_RETAIN_S) -> ProducerTable:
        """Raises ValueError on a file that is not a producers.json of this version."""
        try:
            saved = msgspec.json.decode(raw, type=_Saved)
        except msgspec.DecodeError as exc:
            raise ValueError(f"not a producers file: {exc}") from None
        if saved.version != FILE_VERSION:
            raise ValueError(f"producers file version {saved.version}, this build reads "
                             f"{FILE_VERSION}")
        table = cls(retain_s)
        for s in saved.streams:
            table.streams[(s.producer, s.incarnation, s.client)] = StreamState(
                top=s.top, missing=set(s.missing), recent=OrderedDict(s.recent),
                last_ns=s.last_ns)
        return table
