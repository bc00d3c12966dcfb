"""A bundle that passes validation but makes finalize raise: quarantined, reported, no loop.

Such an input cannot be made on demand (ingest validates every payload), so a fault hook
makes the segment encoder raise whenever a segment holds WAL sequence 6. The shard must
finalize the other bundles, copy bundle 6's WAL entry to quarantine/, report it lost
with its id (``bundles_lost``, status ``lost_sequences``, ``quiver_bundles_lost_total``),
and a restart with the fault still active must not crash (the WAL was released past it),
report it again, or hand its sequence out again (lost.json records it).
"""

from __future__ import annotations

from typing import Any

from quiverd.wal import format as wf
from tests.daemon.test_subscribers import add, consume, produce, wait_for

REFUSE = "finalize=raise:encode_sequence_6"


def test_bundle_that_breaks_finalize_is_quarantined_reported_and_the_rest_delivered(
        daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 300}, in_process=True)
    d.start(faults=REFUSE)
    add(d, "s")
    acks = produce(d, list(range(6)))  # one segment: sequences 1..6, tags 0..5
    assert [a.sequence for a in acks] == [1, 2, 3, 4, 5, 6]
    wait_for(lambda: bool(d.events("bundles_lost")), 10)
    got = consume(d, "s", want=5)
    assert sorted(b.tables[0].column("tag")[0].as_py() for b in got) == [0, 1, 2, 3, 4]
    assert d.running, d.log()[-3000:]
    [lost] = d.events("bundles_lost")
    assert (lost["first_sequence"], lost["last_sequence"]) == (6, 6) and "injected" in lost[
        "error"]
    shard = d.status()["shards"][0]
    assert [6, 6] in shard["lost_sequences"], shard
    copy = d.data_dir / "shard-0/quarantine" / f"refused-{6:016d}.walentry"
    assert lost["quarantine"] == str(copy)
    entry = wf.decode_entry(copy.read_bytes(), 0, max_entry_bytes=1 << 30)
    assert entry.sound and entry.sequence == 6
    assert d.stop() == 0, d.log()[-3000:]
    d.start(faults=REFUSE)  # the same fault: no crash loop, nothing finalized again
    [ack] = produce(d, [6])
    assert ack.sequence == 7  # the refused bundle's sequence is never handed out again
    again = consume(d, "s", want=2, idle_s=1.5)
    assert [b.tables[0].column("tag")[0].as_py() for b in again] == [6]
    assert d.stop() == 0, d.log()[-3000:]
    assert len(d.events("bundles_lost")) == 1, d.events("bundles_lost")  # reported once
    assert not d.events("quiverd_fatal_durability") and "Traceback" not in d.log()
