"""ack.log and the DELETED marker on a 100 % full data filesystem, for real (tmpfs, root only).

The daemon must start (ack.log compaction at startup is deferred, not fatal), serve
reads: a subscriber attaches and drains what is stored, its acks wait for ack.log space
(``acklog_disk_full``) and become durable once space returns, and ingest resumes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from quiverd.acks import format as af
from quiverd.acks.log import AckLogFile, replay_ack_log
from quiverd.client import Client
from quiverd.kernel.errors import NoSpace
from tests.daemon.helpers import tagged_table
from tests.daemon.mounts import MiB, fill, mounted_tmpfs
from tests.daemon.test_disk_full import Log
from tests.daemon.test_subscribers import add, consume, produce, wait_for

N = 300  # their acks outgrow the last page ack.log has: appends find no space


@pytest.mark.parametrize("lake", [False, True], ids=["lake_off", "lake_on"])
def test_daemon_starts_on_a_full_disk_serves_a_drain_and_resumes_when_space_returns(
        daemon_factory: Any, short_dir: Path, lake: bool) -> None:
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50,
                        "subscribers": [], "lake.enabled": lake}, in_process=True)
    with mounted_tmpfs(d.data_dir, 64 * MiB):
        d.start()
        add(d, "sub")
        produce(d, list(range(N)))
        wait_for(lambda: d.status()["shards"][0]["segments"] >= 1)
        assert d.stop() == 0
        ballast = d.data_dir / "ballast"
        fill(ballast)  # 100 % full: not one more page (tmpfs counts pages exactly)
        assert os.statvfs(d.data_dir).f_bavail == 0
        d.start()
        got = consume(d, "sub", want=N)
        assert sorted(b.tables[0].column("tag")[0].as_py() for b in got) == list(range(N))
        wait_for(lambda: bool(d.events("acklog_disk_full")), 10)
        assert d.running, d.log()[-3000:]
        ballast.unlink()
        wait_for(lambda: bool(d.events("acklog_disk_space_back")), 30)
        with Client.connect(d.socket) as c:
            c.send(tagged_table(99), client="p")  # writes are taken again
        time.sleep(0.3)
        assert d.stop() == 0, d.log()[-3000:]
        assert not d.events("quiverd_fatal_durability")
        d.start()
        # The drained acks were made durable: nothing of the first N comes back.
        again = consume(d, "sub", want=N + 1, idle_s=1.5)
        assert [b.tables[0].column("tag")[0].as_py() for b in again] == [99]
        assert d.stop() == 0


def test_deleted_marker_without_space_waits_and_deletes_once_space_returns(
        daemon_factory: Any, short_dir: Path) -> None:
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50}, in_process=True)
    with mounted_tmpfs(d.data_dir, 64 * MiB):
        d.start()
        add(d, "sub")
        produce(d, [1, 2, 3, 4])
        wait_for(lambda: d.status()["shards"][0]["segments"] == 1)
        time.sleep(0.3)  # the WAL's release after the segment write is done
        ballast = d.data_dir / "ballast"
        fill(ballast)
        assert os.statvfs(d.data_dir).f_bavail == 0
        consume(d, "sub", want=4)  # 4 acks fit in ack.log's last page; the marker does not
        wait_for(lambda: bool(d.events("segment_delete_deferred")), 10)
        time.sleep(0.3)
        assert d.running, d.log()[-3000:]
        [deferred] = d.events("segment_delete_deferred")[:1]
        assert deferred["no_space"] is True and deferred["path"].endswith("DELETED")
        assert list((d.data_dir / "shard-0/segments").glob("*.qseg"))  # kept meanwhile
        ballast.unlink()
        wait_for(lambda: bool(d.events("segments_deleted")), 10)
        assert not list((d.data_dir / "shard-0/segments").glob("*.qseg"))
        assert d.stop() == 0, d.log()[-3000:]
        d.start()
        assert consume(d, "sub", want=1, idle_s=1.0) == []
        assert d.stop() == 0
        assert not d.events("bundles_lost") and not d.events("quiverd_fatal_durability")


def test_start_on_a_full_disk_after_a_kill_before_the_floor_write(
        daemon_factory: Any, short_dir: Path) -> None:
    """FLOOR lags the newest segment (kill between its rename and FLOOR): raising it at
    start finds no space; the start goes on and FLOOR follows with the next segment."""
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50})
    with mounted_tmpfs(d.data_dir, 64 * MiB):
        d.start(faults="finalize=kill:renamed")
        add(d, "sub")
        produce(d, [1, 2, 3])
        assert d.wait(10) == -9
        ballast = d.data_dir / "ballast"
        fill(ballast)
        assert os.statvfs(d.data_dir).f_bavail == 0
        d.start()
        assert d.events("segment_floor_deferred"), d.log()[-3000:]
        got = consume(d, "sub", want=3)
        assert sorted(b.tables[0].column("tag")[0].as_py() for b in got) == [1, 2, 3]
        ballast.unlink()
        assert d.stop() == 0, d.log()[-3000:]
        assert not d.events("quiverd_fatal_durability")


def test_ack_log_append_without_space_is_cut_back_and_succeeds_later(tmp_path: Path) -> None:
    """The appender on a real full filesystem: NoSpace, the file as before, then the same
    records appended once space returns; replay reads every one."""
    records = [af.encode(af.SegmentFinalized(segment_seq=s, bundle_count=1))
               for s in range(1, 400)]
    with mounted_tmpfs(tmp_path / "fs", 1 * MiB) as fs:
        path = fs / "ack.log"
        with AckLogFile.open(path) as ack:
            ack.append(records[:1])
            ack.sync()
            fill(fs / "ballast")
            size = path.stat().st_size
            with pytest.raises(NoSpace):
                for r in records[1:]:  # fill the last page, then one record too many
                    ack.append([r])
            assert path.stat().st_size == ack.size  # no partial record
            written = (ack.size - size) // len(records[1])
            (fs / "ballast").unlink()
            ack.append(records[1 + written:])
            ack.sync()
        state = replay_ack_log(path, fs / "q", log=Log())
        assert sorted(state.live_segments()) == list(range(1, 400))
