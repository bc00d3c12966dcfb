"""Range checks of a STREAM request's numbers, before any of them reaches a shard.

msgspec checks a STREAM body's shape (``quiverd.net.consumers``: which fields, of which
JSON type); this checks that every number names something a shard can have:

    field                              allowed                      why
    position [segment_seq, index]      0 .. 2**64 - 1, -1 .. 2**32 - 1
                                                                    u64 segment numbers
                                                                    and u32 bundle indexes
                                                                    on disk (acks/format.py);
                                                                    (s, -1) is before
                                                                    segment s's first bundle,
                                                                    (s, 2**32 - 1) after its
                                                                    last (ranges.END_OF_SEGMENT)
    fetch shard, shard keys of         0 .. shards - 1              a shard of this daemon
    latest start/cap, ack_through
    through (decimal strings)
    latest max_bundles                 0 .. 2**31 - 1               0: no limit (the Spark
                                                                    source's own bound)

Why (issue 26): a fetch after bundle index -2 answered INTERNAL with an IndexError
traceback (-1 reads the segment's last bundle from the end), and ``latest`` from a huge
negative index counted 4.6e18 bundles. A number out of range is the peer's mistake:
``ProtocolError(MALFORMED)`` naming the field, the allowed range and the value, and the
connection closes like any other malformed STREAM request (nothing was read or acked).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from quiverd.kernel.errors import ProtocolError
from quiverd.protocol.frames import ErrorCode

SEGMENT_SEQ_MAX = 2**64 - 1  # u64 segment_seq in ack.log and segment files
BUNDLE_INDEX_MIN = -1  # (s, -1): just before segment s's first bundle
BUNDLE_INDEX_MAX = 2**32 - 1  # u32 on disk; ranges.END_OF_SEGMENT: after its last
MAX_BUNDLES_MAX = 2**31 - 1  # the Spark source's maxBundlesPerTrigger bound

Position = tuple[int, int]


def check(req: msgspec.Struct, shards: int) -> None:
    """Raise ``ProtocolError(MALFORMED)`` for the first number of ``req`` out of range."""
    op = str(req.__struct_config__.tag)  # the request's "op"
    for name in req.__struct_fields__:
        value = getattr(req, name)
        if name == "shard":
            _in_range(op, name, value, 0, shards - 1, "a shard of this daemon")
        elif name == "max_bundles":
            _in_range(op, name, value, 0, MAX_BUNDLES_MAX, "bundles; 0 is no limit")
        elif name in ("after", "through", "start", "cap") and isinstance(value, tuple):
            _position(op, name, value)
        elif name in ("start", "cap", "through") and isinstance(value, Mapping):
            for key, pos in value.items():
                _shard_key(op, name, key, shards)
                _position(op, f"{name}[{key!r}]", pos)


def _position(op: str, field: str, pos: Position) -> None:
    _in_range(op, f"{field}[0]", pos[0], 0, SEGMENT_SEQ_MAX, "a segment number")
    _in_range(op, f"{field}[1]", pos[1], BUNDLE_INDEX_MIN, BUNDLE_INDEX_MAX,
              "a bundle index: -1 is before a segment's first bundle")


def _shard_key(op: str, field: str, key: str, shards: int) -> None:
    if not (key.isascii() and key.isdigit()) or int(key) >= shards:
        raise _malformed(op, f"key {key!r} of {field}", f"must be a shard number, 0 .. "
                         f"{shards - 1} as a decimal string", key)


def _in_range(op: str, field: str, value: int, low: int, high: int, what: str) -> None:
    if not low <= value <= high:
        raise _malformed(op, field, f"must be in {low} .. {high} ({what})", value)


def _malformed(op: str, field: str, rule: str, got: object) -> ProtocolError:
    # The hint goes in the text: a connection-closing ERROR carries the message only.
    shown = repr(got) if isinstance(got, str) else str(got)
    return ProtocolError(ErrorCode.MALFORMED, f"STREAM {op}: {field} {rule}, got "
                         f"{shown[:40]}; positions come from `open` and `latest` replies: "
                         "send them back unchanged")
