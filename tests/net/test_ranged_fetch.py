"""Ranged reads (STREAM requests) against a real daemon: positions, spans, fetch, ack."""

from __future__ import annotations

import time
from typing import Any

import pytest

from quiverd.client import Client
from quiverd.client.consumer import RangedReader
from quiverd.kernel.bundle import read_ipc_stream
from quiverd.kernel.errors import ProtocolError
from quiverd.net.admin import request
from tests.daemon.helpers import tagged_table

FAST = {"shards": 2, "segment.max_open_duration_ms": 50}


def produce(d: Any, tags: list[int], client: str = "p") -> None:
    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(t, rows=10) for t in tags], client=client)


def finalized(d: Any) -> int:
    """Bundles in finalized segments (every shard)."""
    return sum(s["bundles"] for s in request(d.admin_socket, "segments"))


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def read_range(r: RangedReader, name: str, start: dict[str, Any], end: dict[str, Any],
               client: str | None = None) -> list[tuple[tuple[int, int, int], int, str]]:
    """(bundle id, tag, client) of every bundle in (start, end], shard by shard."""
    out = []
    for shard in sorted(end):
        for msg in r.fetch(name, int(shard), start[shard], end[shard], client=client):
            tags = read_ipc_stream(msg.slots[0].ipc).column("tag").to_pylist()
            out.append(((msg.shard, msg.segment_seq, msg.bundle_index), tags[0], msg.client))
    return out


def test_ranged_fetch_same_range_same_bundles_until_acked(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    produce(d, list(range(6)), client="a")
    produce(d, list(range(100, 104)), client="b")
    wait_for(lambda: finalized(d) >= 10)
    with RangedReader.connect(d.socket) as r:
        with pytest.raises(ProtocolError, match="no subscriber named 'sx'"):
            r.open("sx")
    with RangedReader.connect(d.socket) as r:
        opened = r.open("sx", register=True)
        assert opened["registered"] is True and opened["shards"] == 2
        start = opened["start"]
        latest = r.latest("sx", start)
        assert latest["bundles"] == 10
        end = latest["end"]
        first = read_range(r, "sx", start, end)
        assert sorted(t for _, t, _ in first) == [*range(6), *range(100, 104)]
        again = read_range(r, "sx", start, end)
        assert again == first  # a re-run batch reads the same bundles
        only_b = read_range(r, "sx", start, end, client="b")
        assert sorted(t for _, t, _ in only_b) == list(range(100, 104))
        assert {c for _, _, c in only_b} == {"b"}
        assert r.open("sx")["start"] == start  # nothing acked yet
        assert r.ack_through("sx", end) == 10
        # Positions are exact, not canonical: (s, last) and (s + 1, -1) name the same spot.
        assert r.latest("sx", r.open("sx")["start"])["bundles"] == 0
        assert r.latest("sx", end)["end"] == end  # nothing new: the same offset
        assert r.latest("sx", end)["bundles"] == 0
    status = request(d.admin_socket, "subscribers.list")
    assert "sx" in str(status)


def test_ranged_latest_max_bundles_and_cap_bound_the_range(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    request(d.admin_socket, "subscribers.add", {"name": "m", "start": "earliest"})
    produce(d, list(range(20)), client="a")
    produce(d, list(range(20, 40)), client="zz")
    wait_for(lambda: finalized(d) >= 40)
    with RangedReader.connect(d.socket) as r:
        start = r.open("m")["start"]
        seen: list[int] = []
        pos = start
        batches = 0
        while True:
            latest = r.latest("m", pos, max_bundles=7)
            if latest["end"] == pos:
                break
            assert 1 <= latest["bundles"] <= 7
            got = read_range(r, "m", pos, latest["end"])
            assert len(got) == latest["bundles"]
            seen += [t for _, t, _ in got]
            pos = latest["end"]
            batches += 1
        assert sorted(seen) == list(range(40)) and batches == 6
        capped = r.latest("m", start, cap=start)
        assert capped["end"] == start and capped["bundles"] == 0


def test_ranged_reads_survive_a_daemon_restart(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    produce(d, list(range(8)))
    wait_for(lambda: finalized(d) >= 8)
    with RangedReader.connect(d.socket) as r:
        start = r.open("rs", register=True)["start"]
        end = r.latest("rs", start)["end"]
        before = read_range(r, "rs", start, end)
    d.stop()
    d.start()
    with RangedReader.connect(d.socket) as r:
        assert r.open("rs")["start"] == start  # registration and progress are durable
        assert read_range(r, "rs", start, end) == before
        assert r.ack_through("rs", end) == 8
    d.stop()
    d.start()
    with RangedReader.connect(d.socket) as r:
        assert r.latest("rs", r.open("rs")["start"])["bundles"] == 0


def test_ranged_request_malformed_closes_the_connection(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    with RangedReader.connect(d.socket) as r:
        with pytest.raises(ProtocolError, match="STREAM request"):
            r._call({"op": "latest", "subscriber": "x"})  # no start
