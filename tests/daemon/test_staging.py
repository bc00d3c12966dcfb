"""Transactional writes end to end (SPEC §7): staged, then published or discarded once.

Real daemons, real sockets, a real subscriber; PostgreSQL for the two-daemon test.
Spark itself is in tests/spark/test_writer.py: these drive the same protocol by hand.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from quiverd.client import Client
from quiverd.kernel.bundle import TxnTag
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import AtCapacity, CatalogUnavailable, JobConflict
from quiverd.kernel.jobs import Winner
from tests.daemon.helpers import tagged_table
from tests.daemon.test_subscribers import add, consume, produce, wait_for

FAST = {"shards": 2, "segment.max_open_duration_ms": 50, "staging.poll_interval_ms": 100}


def write_attempt(c: Client, job: str, partition: int, attempt: int, tags: list[int], *,
                  end: bool = True, client: str = "spark") -> Winner | None:
    """Stream one task attempt: one bundle per tag (100 rows each), then its end marker."""
    checksum = rows = 0
    items = []
    for tag in tags:
        table = tagged_table(tag)
        items.append((table, TxnTag(job_id=job, partition=partition, attempt=attempt,
                                    row_offset=rows)))
        rows += table.num_rows
        checksum = crc32c(str(tag).encode(), checksum)
    c.send_many(items, client=client)
    if not end:
        return None
    c.end_partition(job, partition, attempt, client=client, rows=rows, checksum=checksum)
    return Winner(partition=partition, attempt=attempt, rows=rows, checksum=checksum)


def tags_of(bundles: list[Any]) -> list[int]:
    return sorted(b.tables[0]["tag"][0].as_py() for b in bundles)


def test_staged_rows_are_invisible_until_commit_then_only_the_winners_are_published(
        daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    add(d, "x")
    with Client.connect(d.socket) as c:
        lost = write_attempt(c, "job1", 0, 7, [1, 2], end=False)  # cut: no end marker
        w0 = write_attempt(c, "job1", 0, 8, [3, 4])  # the retry
        spec = write_attempt(c, "job1", 1, 9, [5])  # partition 1, and a speculative twin
        write_attempt(c, "job1", 1, 10, [6])
    assert lost is None and w0 and spec
    produce(d, [100])  # untagged data flows past the staged job meanwhile
    assert tags_of(consume(d, "x", want=10, idle_s=1.0)) == [100]
    with Client.connect(d.socket) as c:
        assert c.job_status("job1")["state"] == "staged"
        result = c.commit_job("job1", [w0, spec])
        assert result.decision.state == "committed" and not result.already
        assert c.commit_job("job1", [w0, spec]).already  # idempotent
        with pytest.raises(JobConflict):
            c.commit_job("job1", [w0])  # other winners: the first decision stands
        with pytest.raises(JobConflict):
            c.abort_job("job1")
    assert tags_of(consume(d, "x", want=10, idle_s=1.5)) == [3, 4, 5]
    assert tags_of(consume(d, "x", want=10, idle_s=1.0)) == []  # nothing again
    wait_for(lambda: d.status()["shards"][0]["segments"] + d.status()["shards"][1]["segments"]
             == 0)  # the discarded attempts do not hold segments back
    assert d.stop() == 0


def test_abort_discards_the_job_and_frees_its_segments(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    add(d, "x")
    with Client.connect(d.socket) as c:
        write_attempt(c, "job2", 0, 1, [1, 2])
        write_attempt(c, "job2", 1, 2, [3])
        assert c.abort_job("job2", "a task failed").decision.state == "aborted"
        with pytest.raises(JobConflict):
            c.commit_job("job2", [])
    produce(d, [50])
    assert tags_of(consume(d, "x", want=10, idle_s=1.5)) == [50]
    wait_for(lambda: sum(s["segments"] for s in d.status()["shards"]) == 0)
    assert d.stop() == 0


def test_end_marker_is_refused_for_an_incomplete_attempt(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    with Client.connect(d.socket) as c:
        t = tagged_table(1)
        c.send(t, client="spark", txn=TxnTag(job_id="j", partition=0, attempt=1, row_offset=0))
        with pytest.raises(JobConflict, match="took 100 rows"):
            c.end_partition("j", 0, 1, client="spark", rows=200, checksum=0)
        c.send(t, client="spark", txn=TxnTag(job_id="j", partition=0, attempt=2,
                                             row_offset=50))  # a gap: 0..49 never came
        with pytest.raises(JobConflict, match="row_offset 50"):
            c.end_partition("j", 0, 2, client="spark", rows=150, checksum=0)
    assert d.stop() == 0


def test_status_of_a_written_job_is_staged_before_its_segments_finalize(daemon_factory):
    """Its end markers were acked: "staged" at once, not "unknown" until the open
    segments holding them finalize (5 s here), also after a kill -9."""
    d = daemon_factory({**FAST, "segment.max_open_duration_ms": 60_000}).start()
    with Client.connect(d.socket) as c:
        for p in range(2):
            write_attempt(c, "job9", p, 1, [p])
        started = time.monotonic()
        assert c.job_status("job9")["state"] == "staged"
        assert time.monotonic() - started < 5
    d.kill()
    d.start()
    with Client.connect(d.socket) as c:
        status = c.job_status("job9")
        assert c.job_status("never-written")["state"] == "unknown"
    assert status["state"] == "staged" and status["ended_attempts"] == 2, status
    assert d.stop() == 0


def test_kill_9_between_write_and_commit_then_commit_publishes_once(daemon_factory):
    d = daemon_factory(FAST).start()
    add(d, "x")
    with Client.connect(d.socket) as c:
        w = [write_attempt(c, "job3", p, 20 + p, [10 * p, 10 * p + 1]) for p in range(3)]
    d.kill()
    d.start()
    assert tags_of(consume(d, "x", want=10, idle_s=1.0)) == []
    with Client.connect(d.socket) as c:
        assert c.job_status("job3")["state"] == "staged"
        c.commit_job("job3", [x for x in w if x])
    d.kill()  # and again, after the commit: the decision is in the catalog
    d.start()
    assert tags_of(consume(d, "x", want=10, idle_s=1.5)) == [0, 1, 10, 11, 20, 21]
    assert d.stop() == 0


def test_a_job_never_decided_expires_after_the_ttl(daemon_factory):
    d = daemon_factory({**FAST, "staging.ttl_s": 1}, in_process=True).start()
    add(d, "x")
    with Client.connect(d.socket) as c:
        w = write_attempt(c, "job4", 0, 1, [1])
    with Client.connect(d.socket) as c:
        assert c.job_status("job4")["state"] in ("staged", "unknown")  # not finalized yet?
        deadline = time.monotonic() + 15
        while c.job_status("job4")["state"] != "expired" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.job_status("job4")["state"] == "expired"
        with pytest.raises(JobConflict, match="expired"):
            c.commit_job("job4", [w] if w else [])
    assert tags_of(consume(d, "x", want=10, idle_s=1.0)) == []
    assert d.events("staged_job_expired")
    assert d.stop() == 0


def test_two_daemons_sharing_one_postgres_catalog_publish_exactly_once(
        daemon_factory, pg_catalog_dsn):
    settings = {**FAST, "catalog.dsn": pg_catalog_dsn, "lake.enabled": False}
    a = daemon_factory(settings, name="a", in_process=True).start()
    b = daemon_factory(settings, name="b").start()
    for d in (a, b):
        add(d, "x")
    with Client.connect(a.socket) as c:
        wa = write_attempt(c, "job5", 0, 1, [1, 2])
        write_attempt(c, "job5", 1, 2, [3])  # a speculative twin of partition 1 on host a
    with Client.connect(b.socket) as c:
        wb = write_attempt(c, "job5", 1, 3, [4])  # the winner of partition 1, on host b
        write_attempt(c, "job5", 2, 4, [5], end=False)  # cut short on host b
    with Client.connect(a.socket) as c:  # the driver's daemon records the decision
        with pytest.raises(JobConflict, match="no end-of-partition marker on this daemon "
                           "for partitions 1 .attempt 3."):
            c.commit_job("job5", [x for x in (wa, wb) if x])  # b's marker is not on a
        c.commit_job("job5", [x for x in (wa, wb) if x], remote=[1])
    assert tags_of(consume(a, "x", want=10, idle_s=1.5)) == [1, 2]
    assert tags_of(consume(b, "x", want=10, idle_s=1.5)) == [4]
    for d in (a, b):
        assert d.stop() == 0


def test_a_commit_naming_an_attempt_without_its_end_marker_is_refused(daemon_factory):
    """Issue 26: it was recorded, and `visible` answered true with 0 bundles."""
    d = daemon_factory({**FAST, "segment.max_open_duration_ms": 60_000}, in_process=True).start()
    add(d, "x")
    with Client.connect(d.socket) as c:
        write_attempt(c, "cut", 0, 1, [1, 2], end=False)
        made_up = Winner(partition=0, attempt=1, rows=200, checksum=5)
        ended = write_attempt(c, "cut", 1, 2, [3])
        assert ended
        started = time.monotonic()
        with pytest.raises(JobConflict, match=r"job 'cut' not committed: no end-of-partition "
                           r"marker on this daemon for partitions 0 \(attempt 1\)"):
            c.commit_job("cut", [made_up, ended])
        # The marker of partition 1 was in the open segment (60 s): sealed for the check.
        assert time.monotonic() - started < 10
        assert c.job_status("cut")["state"] == "staged"  # nothing recorded
        wrong = Winner(partition=1, attempt=2, rows=100, checksum=ended.checksum + 1)
        with pytest.raises(JobConflict, match="a different end marker for partitions 1"):
            c.commit_job("cut", [wrong])
        assert c.commit_job("cut", [ended]).decision.state == "committed"
    assert tags_of(consume(d, "x", want=10, idle_s=1.5)) == [3]
    assert d.stop() == 0


def test_end_partition_refuses_a_client_name_bundle_would_refuse(daemon_factory):
    """Issue 26: end_partition took `../x`, which BUNDLE refuses (kernel/names.py)."""
    from quiverd.protocol import codec as protocol
    from quiverd.protocol.frames import ErrorCode
    from tests.daemon.test_ingest import _hello, _raw_connect, _read_error

    d = daemon_factory(FAST, in_process=True).start()
    for client in ["../x", "a/b", "", "x" * 300, "é"]:
        bad = _raw_connect(d.socket)
        _hello(bad)
        bad.sendall(protocol.encode_job_request(1, {
            "op": "end_partition", "client": client, "job_id": "j", "partition": 0,
            "attempt": 1, "rows": 0, "checksum": 0}))
        code, message = _read_error(bad)
        bad.close()
        assert code == ErrorCode.MALFORMED and "JOB end_partition: client name" in message
    assert d.status()["staging"]["jobs"] == 0 and not d.status()["shards"][0]["acks"]
    assert d.stop() == 0


def test_staged_rows_over_half_the_size_cap_are_refused_not_left_hanging(daemon_factory):
    # Under backpressure a job bigger than the cap would wait for room only its own
    # commit can free: refuse its bundles with a reason instead (the task fails).
    cap = 1024 * 1024
    d = daemon_factory({**FAST, "retention.size_cap_bytes": cap}, in_process=True).start()
    add(d, "x")
    with Client.connect(d.socket) as c, pytest.raises(AtCapacity, match="undecided jobs"):
        for p in range(1000):  # ~30 KB per partition: refused long before the cap
            write_attempt(c, "big", p, p, list(range(10 * p, 10 * p + 10)))
            time.sleep(0.06)  # its segment is finalized and counted meanwhile
    assert d.status()["staging"]["staged_bytes"] > cap // 2 // 2  # half a shard's share
    produce(d, [7])  # untagged data still flows
    with Client.connect(d.socket) as c:
        c.abort_job("big")
    wait_for(lambda: d.status()["staging"]["staged_bytes"] == 0)
    with Client.connect(d.socket) as c:
        write_attempt(c, "big3", 0, 1, [1])  # room again
    assert d.stop() == 0


def test_a_replay_after_the_commit_reusing_the_winners_attempt_id_is_refused(daemon_factory):
    # Spark counts task attempt ids from 0 in every application: a micro-batch replayed
    # after a restart can carry the winner's (partition, attempt) and the same rows.
    d = daemon_factory(FAST, in_process=True).start()
    add(d, "x")
    with Client.connect(d.socket) as c:
        w = write_attempt(c, "q-7", 0, 0, [1, 2])
        c.commit_job("q-7", [w] if w else [])
    assert tags_of(consume(d, "x", want=10, idle_s=1.5)) == [1, 2]
    with Client.connect(d.socket) as c, pytest.raises(JobConflict, match="already committed"):
        write_attempt(c, "q-7", 0, 0, [1, 2])
    assert tags_of(consume(d, "x", want=10, idle_s=1.0)) == []
    assert d.stop() == 0


def test_job_status_with_the_catalog_down_is_a_retryable_error(daemon_factory, postgres_server,
                                                               pg_catalog_dsn):
    """Issue 17: with PostgreSQL stopped, status answered "staged" / "unknown" from local
    state; it is CatalogUnavailable (retryable) now, and the connection stays usable."""
    d = daemon_factory({**FAST, "catalog.dsn": pg_catalog_dsn, "lake.enabled": False},
                       in_process=True).start()
    with Client.connect(d.socket) as c:
        w = write_attempt(c, "job6", 0, 1, [1, 2])
        assert w
        wait_for(lambda: _retried(lambda: c.job_status("job6"))["state"] == "staged")
        postgres_server.stop("immediate")
        try:
            for job in ("job6", "never-seen"):
                with pytest.raises(CatalogUnavailable, match="catalog is unreachable") as info:
                    c.job_status(job)
                assert info.value.retryable and "retry" in info.value.hint
            with pytest.raises(CatalogUnavailable) as info:  # was INTERNAL, not retried
                c.commit_job("job6", [w])
            assert info.value.retryable
            c.send(tagged_table(9), client="plain")  # same connection: ingest goes on
        finally:
            postgres_server.start()
        assert _retried(lambda: c.job_status("job6"))["state"] == "staged"
        assert _retried(lambda: c.commit_job("job6", [w])).decision.state == "committed"
        assert c.job_status("job6")["state"] == "committed"
    assert d.stop() == 0


def _retried(request: Any, timeout_s: float = 60) -> Any:
    """What a client does with a retryable error: ask again after a pause."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return request()
        except CatalogUnavailable:
            assert time.monotonic() < deadline, "the catalog never came back"
            time.sleep(0.2)
