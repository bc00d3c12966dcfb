"""What `quiverd status` and `segments list` tell an operator, before and after a restart."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from typing import Any

from quiverd.client import Client
from quiverd.net.admin import request
from tests.daemon.helpers import tagged_table


def wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def shard0(d: Any) -> dict[str, Any]:
    return d.status()["shards"][0]  # type: ignore[no-any-return]


def test_status_in_flight_is_zero_once_everything_is_acked(daemon_factory: Any) -> None:
    # Two producers on one shard, released together each round: a small append waits
    # for the group commit while a large one (past flush_bytes) syncs in its own hop
    # and covers it (the early commit). Once both are acked nothing is in flight.
    d = daemon_factory({"shards": 1, "wal.flush_bytes": 256 * 1024,
                        "wal.flush_interval_ms": 1000}, in_process=True).start()
    small, big = tagged_table(1, rows=10), tagged_table(2, rows=20_000, text_bytes=16)
    barrier = threading.Barrier(2)
    stale = []

    def produce(table: Any, check: bool) -> None:
        with Client.connect(d.socket) as c:
            for round_ in range(40):
                barrier.wait(10)
                c.send(table, client="s")
                barrier.wait(10)  # both acked
                if check and shard0(d)["in_flight"] != 0:
                    stale.append(round_)

    threads = [threading.Thread(target=produce, args=(small, True)),
               threading.Thread(target=produce, args=(big, False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    status = shard0(d)
    assert status["acks"] == 80
    assert stale == [] and status["in_flight"] == 0


def test_status_after_clean_restart_keeps_sequence_and_wal_bytes(daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 100}, in_process=True).start()
    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(i, rows=2000) for i in range(20)], client="s")
    # The segment is listed before its WAL region is released (the finalizer's
    # WalReleased reaches the WAL writer a moment later): wait for both.
    wait_for(lambda: shard0(d)["open_bundles"] == 0 and shard0(d)["segments"] >= 1
             and shard0(d)["wal_bytes"] < 4096)
    before = shard0(d)
    assert before["last_sequence"] == 20
    assert d.stop() == 0
    d.start()
    after = shard0(d)
    assert after["last_sequence"] == 20  # not 0: replay knows where the WAL stands
    assert after["wal_bytes"] == before["wal_bytes"]  # released bytes are not live again
    assert after["in_flight"] == 0


def test_status_segments_list_prints_utc_times(daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 100}, in_process=True).start()
    with Client.connect(d.socket) as c:
        c.send(tagged_table(1), client="s")
    wait_for(lambda: shard0(d)["segments"] >= 1)
    out = subprocess.run([sys.executable, "-m", "quiverd", "segments", "list", "--socket",
                          str(d.admin_socket)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "first_ingested" in out.stdout and "min_ts_ns" not in out.stdout
    assert re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", out.stdout), out.stdout


def test_status_shard_dirs_beyond_config_keep_being_served(daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 2, "segment.max_open_duration_ms": 100}, in_process=True).start()
    with Client.connect(d.socket) as c:
        acks = [c.send(tagged_table(i), client=f"client-{i}") for i in range(40)]
    assert {a.shard for a in acks} == {0, 1}
    wait_for(lambda: all(s["open_bundles"] == 0 for s in d.status()["shards"]))
    on_shard1 = sum(1 for a in acks if a.shard == 1)
    assert d.stop() == 0
    d.settings["shards"] = 1
    d._write_config()
    d.start()
    shards = d.status()["shards"]
    assert [s["shard"] for s in shards] == [0, 1]  # shard-1 is still served
    rows = request(d.admin_socket, "segments")
    assert sum(r["bundles"] for r in rows if r["shard"] == 1) == on_shard1
    [warning] = d.events("shards_raised_to_data_on_disk")
    assert warning["configured"] == 1 and warning["serving"] == 2
