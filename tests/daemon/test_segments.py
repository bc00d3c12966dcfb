"""Segments end to end: crash at each finalize step, corrupt files, sequence floor, memory."""

from __future__ import annotations

import os
import time

import pytest

from quiverd.client import Client
from tests.daemon.helpers import flip, stored_bundles, tagged_table

FINALIZE_STEPS = ["finalize=kill:tmp_written", "finalize=kill:tmp_fsynced",
                  "finalize=kill:renamed", "finalize=kill:dir_fsynced",
                  "finalize=kill:floor_written", "wal=kill:sidecar_written"]


@pytest.mark.parametrize("fault", FINALIZE_STEPS)
def test_crash_at_each_finalize_step_keeps_every_bundle_exactly_once(daemon_factory, fault):
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 200})
    d.start(faults=fault)
    acked = {}
    with Client.connect(d.socket) as c:
        for tag, ack in enumerate(c.send_many([tagged_table(t) for t in range(30)], client="c")):
            acked[ack.sequence] = tag
    assert d.wait(20) == -9  # the fault killed it at that step of the first finalize
    if "sidecar" not in fault:
        leftovers = [p.name for p in (d.data_dir / "shard-0/segments").iterdir()]
        assert not any(n.endswith(".qseg") for n in leftovers) or "renamed" in fault or \
            "dir_fsynced" in fault or "floor" in fault
    d.start()  # no faults now
    with Client.connect(d.socket) as c:
        later = c.send_many([tagged_table(1000 + t) for t in range(5)], client="c")
    assert d.stop() == 0
    stored = stored_bundles(d.data_dir)  # asserts no bundle is stored twice
    for seq, tag in acked.items():
        assert stored[(0, seq)].slots[0].equals(tagged_table(tag))
    assert all((0, a.sequence) in stored for a in later)
    assert len(stored) == 35
    assert not list((d.data_dir / "shard-0/segments").glob("*.tmp"))




@pytest.mark.parametrize("damage", ["truncate", "flip_first", "flip_middle", "bad_magic",
                                    "bad_footer"])
def test_corrupt_segment_is_quarantined_and_recovered_from_the_wal(daemon_factory, damage):
    # Die after the segment is durable but before its WAL region is released.
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 100})
    d.start(faults="finalize=kill:floor_written")  # die before the WAL is released
    with Client.connect(d.socket) as c:
        acks = c.send_many([tagged_table(t) for t in range(10)], client="c")
    assert d.wait(20) == -9
    seg = next((d.data_dir / "shard-0/segments").glob("*.qseg"))
    size = seg.stat().st_size
    if damage == "truncate":
        os.chmod(seg, 0o640)
        os.truncate(seg, size // 2)
    elif damage == "flip_first":
        flip(seg, 0)
    elif damage == "flip_middle":
        flip(seg, size // 2)
    elif damage == "bad_magic":
        flip(seg, size - 8)
    else:
        flip(seg, size - 20)  # inside the footer
    d.start()
    status = d.status()["shards"][0]
    assert status["quarantined_segments"], status
    assert (d.data_dir / "shard-0/quarantine" / seg.name).exists()
    assert d.stop() == 0
    stored = stored_bundles(d.data_dir)
    for tag, ack in enumerate(acks):
        assert stored[(0, ack.sequence)].slots[0].equals(tagged_table(tag))
    assert d.events("segment_quarantined")


def test_segment_numbers_never_repeat_after_every_segment_is_deleted(daemon_factory):
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50}, in_process=True).start()
    with Client.connect(d.socket) as c:
        for t in range(3):
            c.send(tagged_table(t), client="f")
            time.sleep(0.2)
    assert d.stop() == 0
    segs = sorted((d.data_dir / "shard-0/segments").glob("*.qseg"))
    highest = int(segs[-1].stem)
    for s in segs:
        s.unlink()
    d.start()
    with Client.connect(d.socket) as c:
        c.send(tagged_table(9), client="f")
    assert d.stop() == 0
    new = sorted((d.data_dir / "shard-0/segments").glob("*.qseg"))
    assert new and all(int(s.stem) > highest for s in new)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_rss_stays_bounded_while_streaming_five_times_target_size(daemon_factory):
    target = 8 << 20
    pending = 16 << 20  # bundle bytes received but not yet durable: part of the bound
    d = daemon_factory({"shards": 1, "segment.target_size_bytes": target,
                        "wal.max_size_bytes": 256 << 20, "ingest.max_bundle_bytes": 4 << 20,
                        "ingest.max_pending_bytes": pending}).start()
    table = tagged_table(0, rows=20_000, text_bytes=40)  # ~1.1 MB of IPC
    peak = 0
    sent = 0
    with Client.connect(d.socket) as c:
        while sent < 6 * target:
            c.send_many([table] * 8, client="m")
            sent += 8 * table.nbytes
            peak = max(peak, _rss_kib(d.proc.pid))
    deadline = time.monotonic() + 10
    while d.status()["shards"][0]["segments"] < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.status()["shards"][0]["segments"] >= 5
    print(f"peak RSS {peak} KiB")
    # The bound documented in the README: base (~150 MiB: Python + pyarrow) + 3 x target
    # (open segment, segment being finalized, its encoded copy) + socket/WAL buffers
    # + ingest.max_pending_bytes + 0.5 MiB for the one connection.
    bound_kib = (150 << 10) + 3 * (target >> 10) + (64 << 10) + (pending >> 10) + 512
    assert peak < bound_kib, f"peak RSS {peak} KiB over bound {bound_kib} KiB"
    assert d.stop() == 0


def test_reused_receive_buffers_never_change_stored_bundles(daemon_factory):
    """Frames of >= 64 KiB are received into pooled buffers reused after each ACK; the
    open segment keeps no payload and the finalizer reads it back from the WAL. Every
    stored bundle must still be the one sent (a buffer reused too early would not be)."""
    d = daemon_factory({"shards": 1, "segment.target_size_bytes": 4 << 20,
                        "ingest.max_bundle_bytes": 1 << 20,
                        "ingest.max_pending_bytes": 2 << 20}, in_process=True).start()
    tables = [tagged_table(tag, rows=3000, text_bytes=30) for tag in range(60)]  # ~150 KB
    with Client.connect(d.socket) as c:
        for start in range(0, len(tables), 12):
            c.send_many(tables[start:start + 12], client="pool")
    assert d.stop() == 0
    stored = stored_bundles(d.data_dir)
    assert len(stored) == len(tables)
    got = [b.slots[0] for b in stored.values()]
    assert sorted(t.column("tag")[0].as_py() for t in got) == list(range(60))
    for t in got:
        assert t.equals(tables[t.column("tag")[0].as_py()])
