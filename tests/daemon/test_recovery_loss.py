"""Recovery reports every loss, with ids, and keeps everything else (real daemon, real files)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from quiverd.client import Client
from quiverd.net.admin import request
from quiverd.segments.reader import SegmentReader
from quiverd.wal import format as wf
from quiverd.wal.dump import dump_wal
from tests.daemon.helpers import flip, stored_bundles, tagged_table
from tests.daemon.test_subscribers import consume


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def wal_released(d: Any) -> bool:
    """The sidecar points at the end of the active WAL: no entry is left to replay."""
    wal_dir = d.data_dir / "shard-0" / "wal"
    try:
        sidecar = wf.decode_sidecar((wal_dir / "truncate.offset").read_bytes(), path="")
    except FileNotFoundError:
        return False
    return sidecar.truncate_offset == (wal_dir / "quiver.wal").stat().st_size




def test_wal_entry_length_past_eof_loses_only_that_entry_and_reports_it(daemon_factory):
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 600_000}).start()
    with Client.connect(d.socket) as c:
        acks = c.send_many([tagged_table(t) for t in range(100)], client="c")
    tag_of = {a.sequence: tag for tag, a in enumerate(acks)}
    d.kill()  # every bundle is acked (fdatasync'd) and only in the WAL
    wal = d.data_dir / "shard-0" / "wal" / "quiver.wal"
    entry = next(r for r in dump_wal(wal) if r.get("sequence") == 30)
    raw = bytearray(wal.read_bytes())
    raw[entry["offset"] : entry["offset"] + 4] = len(raw).to_bytes(4, "little")  # past EOF
    wal.write_bytes(raw)

    d.start()
    shard = d.status()["shards"][0]
    assert shard["lost_sequences"] == [[30, 30]]
    assert shard["replay"]["corrupt_entries"] == 1 and shard["replay"]["torn_tail_bytes"] == 0
    assert d.status()["metrics"]["quiver_wal_corrupt_entries_total"] == 1
    [lost] = d.events("bundles_lost")
    assert (lost["first_sequence"], lost["last_sequence"], lost["bundles"]) == (30, 30, 1)
    assert not d.events("wal_torn_tail")
    copy = d.data_dir / "shard-0" / "quarantine" / f"quiver.wal.0.{entry['offset']}.skipped"
    assert copy.read_bytes() == raw[entry["offset"] : entry["offset"] + entry["bytes"]]
    assert d.stop() == 0

    stored = stored_bundles(d.data_dir)  # asserts nothing is stored twice
    assert sorted(seq for _, seq in stored) == [s for s in range(1, 101) if s != 30]
    for (_, seq), bundle in stored.items():
        assert bundle.slots[0].equals(tagged_table(tag_of[seq]))


def test_quarantined_newest_segment_loss_is_reported_with_its_bundle_ids(daemon_factory):
    # A flip in the manifest: the metadata CRC catches it at startup (format version 2).
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50}, in_process=True).start()
    request(d.admin_socket, "subscribers.add", {"name": "s", "start": "earliest"})
    newest, sequences = two_segments_released(d)
    with SegmentReader.open(newest) as reader:
        footer = reader.footer
    flip(newest, footer.manifest_offset + footer.manifest_length // 2)

    d.start()
    shard = d.status()["shards"][0]
    assert shard["quarantined_segments"] and shard["segments"] == 1
    assert shard["lost_sequences"] == [[min(sequences), max(sequences)]]
    events = d.events("bundles_lost")
    assert {(e.get("first_sequence"), e.get("last_sequence")) for e in events} >= {
        (min(sequences), max(sequences))}
    [by_segment] = [e for e in events if "segment_seq" in e]
    assert (by_segment["segment_seq"], by_segment["bundle_count"]) == (int(newest.stem), 7)
    assert by_segment["bundle_ids"] == f"(0, {int(newest.stem)}, 0..6)"
    assert [e["segment_seq"] for e in d.events("segment_forgotten")] == [int(newest.stem)]
    nothing_waits_on_the_lost_segment(d, newest, sequences, [0, 1, 2, 3, 100])


@pytest.mark.parametrize("found_by", ["read", "scrub"])
def test_segment_with_a_flipped_data_byte_is_quarantined_after_startup(daemon_factory, found_by):
    # A flip in a stream's bytes: startup does not read them (ready without it); the
    # first read (scrubber off) or the scrubber (no subscriber reading) finds it, and
    # its bundles are reported lost with their ids, as startup reports them.
    rate = 0 if found_by == "read" else 50
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50,
                        "scrub.rate_mb_per_s": rate}, in_process=True).start()
    request(d.admin_socket, "subscribers.add", {"name": "s", "start": "earliest"})
    newest, sequences = two_segments_released(d)
    flip(newest, 200)  # inside the first stream's IPC file

    d.start()
    shard = d.status()["shards"][0]
    assert not shard["quarantined_segments"]  # recovery did not find it: it never looked
    assert shard["replay"]["bundles_lost"] == 0
    if found_by == "read":
        assert shard["segments"] == 2 and shard["scrub"]["unverified_segments"] == 2
        got = consume(d, "s", want=4)  # the good segment; the bad one is never delivered
        assert sorted(b.tables[0]["tag"][0].as_py() for b in got) == [0, 1, 2, 3]
    wait_for(lambda: d.status()["shards"][0]["scrub"]["quarantined"])
    scrub = d.status()["shards"][0]["scrub"]
    [q] = scrub["quarantined"]
    assert (q["segment_seq"], q["found_by"], q["bundle_count"]) == (int(newest.stem), found_by, 7)
    assert scrub["corrupt_found"][found_by] == 1
    assert (d.data_dir / "shard-0" / "quarantine" / newest.name).exists()
    assert not newest.exists()
    [lost] = d.events("bundles_lost")
    assert (lost["segment_seq"], lost["bundle_count"], lost["found_by"]) == (
        int(newest.stem), 7, found_by)
    assert lost["bundle_ids"] == f"(0, {int(newest.stem)}, 0..6)"
    assert (lost["first_sequence"], lost["last_sequence"]) == (min(sequences), max(sequences))
    assert d.events("segment_quarantined")
    metrics = d.status()["metrics"]
    assert metrics["quiver_bundles_lost_total"] == 7
    nothing_waits_on_the_lost_segment(d, newest, sequences,
                                      [100] if found_by == "read" else [0, 1, 2, 3, 100])
    # ack.log forgot the segment durably: the next startup finds nothing more to report.
    d.start()
    shard = d.status()["shards"][0]
    assert not shard["quarantined_segments"] and not shard["lost_bundles"]
    assert d.stop() == 0


def two_segments_released(d: Any) -> tuple[Path, list[int]]:
    """Four bundles in one segment, seven in the next; the WAL released both; stopped."""
    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(t) for t in range(4)], client="c")
        wait_for(lambda: d.status()["shards"][0]["segments"] == 1)
        c.send_many([tagged_table(10 + t) for t in range(7)], client="c")
        wait_for(lambda: d.status()["shards"][0]["segments"] == 2)
    wait_for(lambda: wal_released(d))  # the WAL no longer holds the newest segment
    assert d.stop() == 0
    _, newest = sorted((d.data_dir / "shard-0" / "segments").glob("*.qseg"))
    with SegmentReader.open(newest) as reader:
        sequences = [b.sequence for b in reader.bundles()]
    assert len(sequences) == 7
    return newest, sequences


def nothing_waits_on_the_lost_segment(d: Any, newest: Path, sequences: list[int],
                                      tags: list[int]) -> None:
    with Client.connect(d.socket) as c:  # lost sequences are never handed out again
        [ack] = c.send_many([tagged_table(100)], client="c")
    assert ack.sequence == max(sequences) + 1
    got = consume(d, "s", want=len(tags))  # ack.log forgot the lost segment: nothing waits
    assert sorted(b.tables[0]["tag"][0].as_py() for b in got) == tags
    assert all(b.id[1] != int(newest.stem) for b in got)
    wait_for(lambda: request(d.admin_socket, "subscribers.list")[0]["lag_bundles"] == 0)
    assert d.stop() == 0
