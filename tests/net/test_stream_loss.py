"""Ranged reads that retention outran, and one reader per subscriber (issue 26).

Against a real daemon: ``max_age`` retention deletes segments a ranged reader has not
read; ``latest`` and ``fetch`` must name them (``lost``), while segments deleted
because the reader acked them are never reported. The lease: a second holder is
refused naming the first, until the first releases or its process ends.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from quiverd.client.consumer import RangedReader
from quiverd.kernel.errors import AtCapacity
from quiverd.net.admin import request
from tests.net.test_ranged_fetch import finalized, produce, read_range, wait_for

AGED = {"shards": 1, "segment.max_open_duration_ms": 50, "retention.max_age_s": 1}
FAST = {"shards": 1, "segment.max_open_duration_ms": 50}
END_OF_SEGMENT = 0xFFFF_FFFF  # quiverd_actors.ranges.END_OF_SEGMENT


def segments(d: Any) -> list[int]:
    return [s["segment_seq"] for s in request(d.admin_socket, "segments")]


def test_ranged_latest_and_fetch_name_bundles_retention_deleted(daemon_factory):
    d = daemon_factory(AGED, in_process=True).start()
    with RangedReader.connect(d.socket) as r:
        start = r.open("late", register=True)["start"]  # before any bundle
        produce(d, [1, 2, 3])
        wait_for(lambda: finalized(d) == 3)
        first = r.latest("late", start, max_bundles=1)  # a batch cut inside the segment
        assert first["lost"] == [] and first["bundles"] == 1
        seg = first["end"]["0"][0]
        cut = first["end"]
        planned = r.latest("late", start)["end"]
        assert planned["0"] == [seg, END_OF_SEGMENT]  # a finalized segment's end
        wait_for(lambda: seg not in segments(d), timeout=15)  # max_age deleted it unread
        reply = r.latest("late", start)
        assert reply["bundles"] == 0
        [run] = reply["lost"]
        assert run["shard"] == 0 and run["segments"] == [seg, seg]
        assert run["after"] == [seg, -1] and run["dropped_bundles"] == 3
        # Nothing live after it: the range passes over the deleted segment, so a reader
        # that goes on is told once, not at every trigger.
        assert reply["end"]["0"] == [seg, END_OF_SEGMENT]
        assert r.latest("late", reply["end"])["lost"] == []
        # From a start inside the deleted segment: the rest of it is lost.
        [rest] = r.latest("late", cut)["lost"]
        assert rest["after"] == cut["0"] and rest["segments"] == [seg, seg]
        # A re-run batch over the deleted range gets no bundle and the same report.
        lost: list[dict[str, Any]] = []
        got = list(r.fetch("late", 0, start["0"], planned["0"], lost=lost))
        assert got == [] and [x["segments"] for x in lost] == [[seg, seg]]
        produce(d, [4])
        wait_for(lambda: r.latest("late", reply["end"])["bundles"] == 1)
        after = r.latest("late", reply["end"])
        assert after["lost"] == []
        assert [t for _, t, _ in read_range(r, "late", reply["end"], after["end"])] == [4]


def test_ranged_acked_segments_deleted_are_not_reported_lost(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    with RangedReader.connect(d.socket) as r:
        start = r.open("acker", register=True)["start"]
        produce(d, [1, 2, 3])
        wait_for(lambda: finalized(d) == 3)
        end = r.latest("acker", start)["end"]
        [seg] = segments(d)
        assert r.ack_through("acker", end) == 3
        wait_for(lambda: seg not in segments(d), timeout=15)  # deleted: acked by all
        reply = r.latest("acker", end)
        assert (reply["end"], reply["bundles"], reply["lost"]) == (end, 0, [])
        lost: list[dict[str, Any]] = []
        assert list(r.fetch("acker", 0, end["0"], end["0"], lost=lost)) == [] and lost == []


def test_ranged_lease_refuses_a_second_holder_until_released(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    with RangedReader.connect(d.socket) as r, RangedReader.connect(d.socket) as other:
        start = r.open("one", register=True, holder="query A")["start"]
        assert r.latest("one", start, holder="query A")["bundles"] == 0  # renews
        with pytest.raises(AtCapacity, match=r"subscriber 'one' is read by another live "
                                             r"query \(query A, since .*while process"):
            other.open("one", holder="query B")
        with pytest.raises(AtCapacity, match="query A"):
            other.ack_through("one", start)  # no holder: refused while A holds it
        other.latest("one", start)  # reading without a holder stays allowed
        assert r.release("one", "query A") is True
        assert other.open("one", holder="query B")["start"] == start
        assert r.release("one", "query A") is False


def test_ranged_lease_ends_with_the_holders_process(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    with RangedReader.connect(d.socket) as r:
        r.open("crashed", register=True)
    code = ("import sys; from quiverd.client.consumer import RangedReader; "
            "r = RangedReader.connect(sys.argv[1]); r.open('crashed', holder='dead driver')")
    subprocess.run([sys.executable, "-c", code, str(d.socket)], check=True, timeout=60)
    with RangedReader.connect(d.socket) as r:  # its process is gone: no wait
        assert r.open("crashed", holder="restarted driver")["shards"] == 1


def test_stream_leases_timeout_where_the_pid_is_unknown():
    from quiverd.net.stream_leases import StreamLeases, SubscriberBusy

    now = [100.0]
    leases = StreamLeases(clock=lambda: now[0], alive=lambda pid: pid == 7)
    leases.take("s", "A", pid=0, lease_s=30)
    now[0] += 29
    with pytest.raises(SubscriberBusy, match=r"\(A, .*until 1 s after its last request"):
        leases.take("s", "B", pid=0)
    now[0] += 2
    leases.take("s", "B", pid=7)  # A's lease ran out; B's process lives
    now[0] += 10_000
    with pytest.raises(SubscriberBusy, match="while process 7 runs"):
        leases.check("s")
    assert leases.holder("s") == "B"
