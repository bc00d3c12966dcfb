"""Writer leases (SPEC §7, runtime/leases.py): a job whose writer is gone is decided in
seconds, not a day; a live writer's job never expires; an operator lists and aborts.

Real daemons, real client processes killed with SIGKILL, the real CLI, STREAM ranged
reads (what ``spark.readStream.format("quiver")`` uses).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from quiverd.client import Client
from quiverd.client.consumer import RangedReader
from quiverd.kernel.bundle import TxnTag, read_ipc_stream
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import JobConflict
from quiverd.kernel.jobs import Winner
from tests.daemon.helpers import tagged_table
from tests.daemon.test_cli import quiverd
from tests.daemon.test_metrics import scrape
from tests.daemon.test_subscribers import produce, wait_for

# One shard: the staged job and the rows after it meet in one ordered stream.
FAST = {"shards": 1, "segment.max_open_duration_ms": 50, "staging.poll_interval_ms": 100,
        "staging.writer_timeout_s": 2}

WRITER = textwrap.dedent("""
    import sys, time
    from quiverd.client import Client
    from quiverd.kernel.bundle import TxnTag
    from tests.daemon.helpers import tagged_table
    c = Client.connect(sys.argv[1])
    c.send_many([(tagged_table(t), TxnTag(job_id=sys.argv[2], partition=0, attempt=1,
                                           row_offset=100 * i))
                 for i, t in enumerate([1, 2])], client="p")
    print("sent", flush=True)
    time.sleep(600)  # killed here: no end marker, no commit, no abort
""")


def start_writer(d: Any, job: str) -> subprocess.Popen[str]:
    """A producer process that stages two bundles of ``job`` and then hangs."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(d.socket), job],
                            stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert proc.stdout is not None and proc.stdout.readline().strip() == "sent"
    return proc


def read_all(r: RangedReader, start: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """latest from ``start`` and the tags of the range's bundles."""
    reply = r.latest("s", start)
    tags = []
    for shard, end in reply["end"].items():
        for got in r.fetch("s", int(shard), start[shard], end):
            tags.append(read_ipc_stream(got.slots[0].ipc)["tag"][0].as_py())
    return reply, tags


def stream_tags_until(d: Any, want: int, timeout_s: float) -> tuple[list[int], list[Any]]:
    """Read the stream from the start until tag ``want`` arrives; every latest reply."""
    tags: list[int] = []
    replies: list[Any] = []
    with RangedReader.connect(d.socket, timeout=30) as r:
        start = r.open("s", register=True)["start"]
        deadline = time.monotonic() + timeout_s
        while want not in tags and time.monotonic() < deadline:
            reply, got = read_all(r, start)
            replies.append(reply)
            tags += got
            start = reply["end"]
            time.sleep(0.1)
    return tags, replies


def test_a_killed_writers_job_expires_within_the_writer_timeout_and_the_stream_moves_on(
        daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    writer = start_writer(d, "dead-job")
    produce(d, [100])  # after the staged bundles, in the same shard: held behind them
    with RangedReader.connect(d.socket, timeout=30) as r:
        start = r.open("s", register=True)["start"]
        wait_for(lambda: r.latest("s", start).get("waiting"))
        reply, tags = read_all(r, start)
        # The stream says what it waits for: the job and where.
        assert reply["waiting"]["0"]["job_id"] == "dead-job" and tags == []
    time.sleep(2.5)  # longer than writer_timeout_s: the live (hung) writer keeps the job
    with Client.connect(d.socket) as c:
        assert c.job_status("dead-job")["state"] == "staged"
    killed = time.monotonic()
    writer.send_signal(signal.SIGKILL)
    writer.wait(10)
    assert writer.stdout is not None
    writer.stdout.close()
    tags, _ = stream_tags_until(d, 100, timeout_s=20)
    took = time.monotonic() - killed
    assert tags == [100], tags  # the staged rows are discarded, the rest delivered
    assert took < 2 + 4, f"the job was decided {took:.1f} s after its writer died"
    with Client.connect(d.socket) as c:
        status = c.job_status("dead-job")
    assert status["state"] == "expired" and "writer_timeout_s=2" in status["reason"]
    assert d.events("staged_job_expired") and d.events("job_writer_gone")
    assert d.stop() == 0


def test_a_slow_live_writer_keeps_its_job_with_keepalives_past_the_idle_timeout(
        daemon_factory):
    # An idle timeout of 2 s: at 1 s a loaded clean-clone run (4 workers, 2 cores) once
    # let a 250 ms keepalive cadence slip past it and the connection was closed.
    d = daemon_factory({**FAST, "staging.writer_timeout_s": 1,
                        "ingest.idle_timeout_ms": 2000}, in_process=True).start()
    with Client.connect(d.socket) as c:
        first = c.keepalive("slow")  # before any row: the job is held
        assert first.keepalive_ms == 250 and first.state == "unknown"
        table = tagged_table(1)
        c.send(table, client="p", txn=TxnTag(job_id="slow", partition=0, attempt=3,
                                              row_offset=0))
        deadline = time.monotonic() + 8  # 8 x writer_timeout_s, 4 x the idle timeout
        while time.monotonic() < deadline:
            time.sleep(first.keepalive_ms / 1000)
            assert c.keepalive("slow").state == "staged"  # waiting for input
        listed = json.loads(quiverd("jobs", "list", "--json", "--socket",
                                    str(d.admin_socket)).stdout)
        assert [(j["job_id"], j["writers"], j["expires_in_s"]) for j in listed] == [
            ("slow", 1, None)]
        end = c.end_partition("slow", 0, 3, client="p", rows=100, checksum=7)
        assert end.sequence > 0
        result = c.commit_job("slow", [Winner(partition=0, attempt=3, rows=100, checksum=7)])
    assert result.decision.state == "committed"
    assert not d.events("staged_job_expired")
    assert d.stop() == 0


def test_jobs_list_and_abort_from_the_cli_release_a_waiting_stream(daemon_factory):
    d = daemon_factory({**FAST, "staging.writer_timeout_s": 600,
                        "metrics.listen": "127.0.0.1:0"}, in_process=True).start()
    admin = ["--socket", str(d.admin_socket)]
    with Client.connect(d.socket) as c:  # a writer that closed without a decision
        checksum = crc32c(b"1")
        c.send(tagged_table(1), client="p", txn=TxnTag(job_id="stuck", partition=0,
                                                       attempt=1, row_offset=0))
        c.end_partition("stuck", 0, 1, client="p", rows=100, checksum=checksum)
    produce(d, [100])
    wait_for(lambda: d.status()["staging"]["holding"])
    rows = json.loads(quiverd("jobs", "list", "--json", *admin).stdout)
    assert [(j["job_id"], j["writers"], j["holding_shards"], j["ended_attempts"])
            for j in rows] == [("stuck", 0, [0], 1)]
    assert 590 < rows[0]["expires_in_s"] <= 600
    text = quiverd("jobs", "list", *admin).stdout
    assert "stuck" in text and "expires_in_s" in text
    status = quiverd("status", *admin).stdout
    assert "shard 0 delivery waits for undecided job stuck" in status
    held = scrape(d.events("metrics_listening")[0]["address"])["quiver_delivery_held_seconds"]
    assert list(held) == [(("job_id", "stuck"), ("shard", "0"))]
    out = quiverd("jobs", "abort", "stuck", "--reason", "ticket 42", *admin).stdout
    assert "job stuck is now aborted (aborted by an operator: ticket 42)" in out
    out = quiverd("jobs", "abort", "stuck", *admin).stdout
    assert "was already aborted" in out
    tags, _ = stream_tags_until(d, 100, timeout_s=10)
    assert tags == [100]
    assert json.loads(quiverd("jobs", "list", "--json", *admin).stdout) == []
    with Client.connect(d.socket) as c:
        with pytest.raises(JobConflict, match="aborted"):
            c.commit_job("stuck", [Winner(partition=0, attempt=1, rows=100,
                                          checksum=checksum)])
    bad = quiverd("jobs", "abort", "", *admin, check=False)
    assert bad.returncode == 1 and "job_id" in bad.stderr
    assert d.stop() == 0


def test_a_restarted_daemon_gives_recovered_jobs_the_grace_then_expires_them(
        daemon_factory):
    d = daemon_factory({**FAST, "staging.writer_timeout_s": 3}).start()
    with Client.connect(d.socket) as c:
        c.send(tagged_table(1), client="p", txn=TxnTag(job_id="j", partition=0, attempt=1,
                                                       row_offset=0))
    wait_for(lambda: d.status()["staging"]["jobs"] == 1)
    time.sleep(2)
    d.kill()
    d.start()
    started = time.monotonic()
    with Client.connect(d.socket) as c:
        assert c.job_status("j")["state"] == "staged"  # not expired at once
        wait_for(lambda: c.job_status("j")["state"] == "expired", timeout=15)
    took = time.monotonic() - started
    assert 2.5 < took < 3 + 4, f"expired {took:.1f} s after the restart"
    assert d.stop() == 0
