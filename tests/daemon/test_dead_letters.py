"""Dead letters (issue 29, item 2): a bundle the lake cannot write (a column type Parquet
cannot hold) is set aside in the store and rejected, within a minute; the bundles it
shared files with, and every later one of its client, land; the janitor keeps it;
``quiverd dead-letters`` lists it and ``--replay`` sends it again. With the Iceberg
projection on, it is also a data file of ``quiver_dead_letters.<client>``, readable with
pyiceberg, once, also when the daemon is killed around that step."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from quiverd.client import Client
from quiverd.kernel.bundle import read_ipc_stream
from tests.daemon.iceberg_helpers import catalog, wait_projected
from tests.daemon.lake_helpers import (
    FAST_LAKE,
    assert_exactly_once,
    lake_contents,
    logs_table,
    quiverd_cli,
    wait_for_lake,
)
from tests.daemon.test_metrics import scrape

FAST_ICEBERG = {**FAST_LAKE, "lake.iceberg.enabled": True,
                "lake.iceberg.reconcile_interval_s": 0.5, "lake.iceberg.linger_ms": 50}
DEAD_NS = "quiver_dead_letters"


def poison() -> pa.Table:
    union = pa.UnionArray.from_dense(pa.array([0, 1], pa.int8()), pa.array([0, 0], pa.int32()),
                                     [pa.array([1]), pa.array(["a"])])
    return pa.table({"u": union})


def dead_letters(d: Any) -> list[dict[str, Any]]:
    out = quiverd_cli("dead-letters", "--config", str(d.config_path), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_bundle_the_lake_cannot_write_is_a_dead_letter_and_the_rest_lands(
        daemon_factory: Any) -> None:
    d = daemon_factory({**FAST_LAKE, "lake.janitor.grace_s": 0}, in_process=True).start()
    sent: Any = {}
    with Client.connect(d.socket) as c:
        # The poison bundle between two good ones of its client: they share its first file.
        for i, t in enumerate((logs_table(0, 0), poison(), logs_table(0, 1))):
            c.send(t, client="bad")
            if i != 1:
                sent[("bad", 0)] = sent.get(("bad", 0), 0) + t.num_rows
        c.send(logs_table(1, 0), client="good")
        sent[("good", 0)] = 50
    started = time.monotonic()
    deadline = started + 60
    while not (found := dead_letters(d)):
        assert time.monotonic() < deadline, d.log()[-3000:]
        time.sleep(0.5)
    landed_s = time.monotonic() - started
    [letter] = found
    assert (letter["client"], letter["slot"], letter["rows"]) == ("bad", 0, 2)
    assert "dense_union" in letter["error"] and letter["attempts"] == 3
    with Client.connect(d.socket) as c:  # the client goes on
        c.send(logs_table(0, 2), client="bad")
        sent[("bad", 0)] += 50
    wait_for_lake(d, Counter_of(sent))
    rows, tables = lake_contents(d)
    assert_exactly_once(rows, tables, Counter_of(sent))
    [event] = d.events("lake_bundle_dead_lettered")
    assert event["client"] == "bad" and "quiverd dead-letters" in event["hint"]
    metrics = d.status()["metrics"]
    assert metrics["quiver_subscriber_rejects_total"] == {"uploader": 1}, metrics
    out = quiverd_cli("janitor", "--config", str(d.config_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(dead_letters(d)) == 1  # not an orphan to the janitor
    # Replayed (here with the cause not fixed): sent again as a new bundle, its old
    # object deleted, and set aside again under the new bundle's id.
    out = quiverd_cli("dead-letters", "--config", str(d.config_path), "--replay",
                      str(d.socket))
    assert out.returncode == 0 and "1 dead letters sent again" in out.stdout, out.stderr
    deadline = time.monotonic() + 60
    while [x["bundle_index"] for x in dead_letters(d)] in ([], [letter["bundle_index"]]):
        assert time.monotonic() < deadline, d.log()[-2000:]
        time.sleep(0.5)
    [again] = dead_letters(d)
    assert (again["segment_seq"], again["bundle_index"]) != (letter["segment_seq"],
                                                             letter["bundle_index"])
    print(f"dead letter landed {landed_s:.1f} s after its send")


def Counter_of(sent: dict[Any, int]) -> Any:  # noqa: N802 - reads as the type it builds
    return Counter(sent)


def table_files(d: Any, client: str, **kw: Any) -> list[str]:
    """The data files of the client's dead-letter table ([] before it exists)."""
    cat = catalog(d, **kw)
    if not cat.table_exists((DEAD_NS, client)):
        return []
    files: list[str] = cat.load_table((DEAD_NS, client)).inspect.files()["file_path"].to_pylist()
    return files


def dead_rows(d: Any, client: str, **kw: Any) -> pa.Table:
    # A tuple: "quiver_dead_letters.bad.x" as a string is table x of namespace ...bad.
    return catalog(d, **kw).load_table((DEAD_NS, client)).scan().to_arrow()


def wait_table_files(d: Any, client: str, until: Any, timeout: float = 60,
                     **kw: Any) -> list[str]:
    deadline = time.monotonic() + timeout
    while not until(files := table_files(d, client, **kw)):
        assert time.monotonic() < deadline, (files, d.log()[-3000:])
        time.sleep(0.3)
    return files


def location_of(d: Any, key: str) -> str:
    return f"file://{d.data_dir / 'objects'}/{key}"


def test_a_dead_letter_is_a_file_of_its_clients_iceberg_table_and_replay_removes_it(
        daemon_factory: Any) -> None:
    """The dead letter of client ``bad.x`` (a dot: one name, not a namespace level) is
    in ``quiver_dead_letters.bad.x`` within a minute, its payload decoding to the poison
    rows; the client's good rows land in ``quiver.bad.x`` (the projection's table, which
    the reconciler keeps syncing beside it); the metric has client and reason; a replay
    takes the old file out of the table (here the cause is not fixed: the replayed
    bundle is a dead letter again, the table's only file)."""
    d = daemon_factory({**FAST_ICEBERG, "metrics.listen": "127.0.0.1:0"},
                       in_process=True).start()
    [listening] = d.events("metrics_listening")
    client = "bad.x"
    sent: Counter[tuple[str, int]] = Counter()
    started = time.monotonic()
    with Client.connect(d.socket) as c:
        for i, t in enumerate((logs_table(0, 0), poison(), logs_table(0, 1))):
            c.send(t, client=client)
            if i != 1:
                sent[(client, 0)] += t.num_rows
        c.send(logs_table(1, 0), client="good")
        sent[("good", 0)] += 50
    [first] = wait_table_files(d, client, bool)
    took_s = time.monotonic() - started
    assert took_s < 60
    [letter] = dead_letters(d)
    assert first == location_of(d, letter["key"]) and letter["in_table"] is True
    out = quiverd_cli("dead-letters", "--config", str(d.config_path))
    assert " encode " in out.stdout and "NOT IN TABLE" not in out.stdout, out
    rows = dead_rows(d, client).to_pylist()
    assert [(r["client"], r["slot"], r["rows"], r["reason"], r["attempts"]) for r in rows] == [
        (client, 0, 2, "encode", 3)]
    assert "dense_union" in rows[0]["error"]
    assert read_ipc_stream(rows[0]["payload"]).equals(poison())
    with Client.connect(d.socket) as c:  # the client goes on
        c.send(logs_table(0, 2), client=client)
        sent[(client, 0)] += 50
    wait_for_lake(d, sent)
    assert_exactly_once(*lake_contents(d), sent)
    wait_projected(d)
    main = catalog(d).load_table(("quiver", client))  # the projection's own table
    assert main.scan().to_arrow().num_rows == 150
    assert table_files(d, client) == [first]  # ... and the reconciler left this one alone
    assert [i[-1] for i in catalog(d).list_tables(DEAD_NS)] == [client]
    assert sorted(i[-1] for i in catalog(d).list_tables("quiver")) == [client, "good"]
    samples = scrape(listening["address"])
    assert samples["quiver_lake_dead_letters_total"] == {
        (("client", client), ("reason", "encode")): 1.0}, samples["quiver_lake_dead_letters_total"]
    out = quiverd_cli("dead-letters", "--config", str(d.config_path), "--replay",
                      str(d.socket))
    assert out.returncode == 0 and "1 dead letters sent again" in out.stdout, out.stderr
    [again] = wait_table_files(d, client, lambda files: files and files != [first])
    assert again != first
    [letter] = dead_letters(d)
    assert again == location_of(d, letter["key"])
    print(f"dead letter in its Iceberg table {took_s:.1f} s after its send")


@pytest.mark.parametrize("step", ["dead_letter_written", "dead_letter_committed"])
def test_a_dead_letter_is_in_its_table_once_after_a_kill_around_its_commit(
        daemon_factory: Any, step: str) -> None:
    """kill -9 after the object is written (before the Iceberg commit), or after the
    commit (before the REJECT): the bundle comes back after the restart, fails again and
    is set aside again, and the table holds its file exactly once."""
    d = daemon_factory(FAST_ICEBERG).start(faults=f"lake=kill:{step}")
    with Client.connect(d.socket) as c:
        c.send(poison(), client="bad")
    assert d.wait(60) == -9, d.log()[-3000:]
    if step == "dead_letter_committed":
        assert len(table_files(d, "bad")) == 1  # it landed; the REJECT did not
    else:
        assert table_files(d, "bad") == []
    d.start()
    deadline = time.monotonic() + 60
    while d.status()["metrics"]["quiver_subscriber_rejects_total"].get("uploader") != 1:
        assert time.monotonic() < deadline, d.log()[-3000:]
        time.sleep(0.3)
    [letter] = dead_letters(d)
    assert table_files(d, "bad") == [location_of(d, letter["key"])]
    assert [r["slot"] for r in dead_rows(d, "bad").to_pylist()] == [0]
    assert d.stop() == 0


def test_a_dead_letter_waits_for_a_file_in_flight_holding_a_slot_of_it(
        daemon_factory: Any, short_dir: Any) -> None:
    """Slot 0's file is held before its upload (a gate) while slot 1 fails its third
    time: the bundle is not set aside (nor rejected) until that file settles, so the
    dead letter neither holds slot 0's rows (they land) nor loses them (had the file
    failed, they would be in it)."""
    gate = short_dir / "gate"
    gate.touch()
    d = daemon_factory({**FAST_LAKE, "lake.janitor.grace_s": 0}, in_process=True).start(
        faults=f"lake.object_written=gate:{gate}")
    try:
        with Client.connect(d.socket) as c:
            c.send({0: logs_table(0, 0), 1: poison()}, client="bad")
        deadline = time.monotonic() + 60
        while len([e for e in d.events("lake_file_failed") if e["slot"] == 1]) < 3:
            assert time.monotonic() < deadline, d.log()[-3000:]
            time.sleep(0.2)
        time.sleep(3)  # several redeliveries (the dead letter came 1.6 s after the send)
        assert dead_letters(d) == []
    finally:
        gate.unlink()
    deadline = time.monotonic() + 60
    while not (found := dead_letters(d)):
        assert time.monotonic() < deadline, d.log()[-3000:]
        time.sleep(0.3)
    assert [(x["slot"], x["rows"]) for x in found] == [(1, 2)]
    sent = Counter({("bad", 0): 50})
    wait_for_lake(d, sent)
    assert_exactly_once(*lake_contents(d), sent)


def test_a_dead_letter_lands_in_its_table_on_postgresql_and_s3(
        daemon_factory: Any, pg_catalog_dsn: str, s3_bucket: dict[str, str],
        s3_server: Any) -> None:
    """The same through a PostgreSQL catalog and an S3 store (moto): the table's file is
    the object's s3:// location, read back through pyiceberg's S3 FileIO."""
    from tests.daemon.test_lake_pg_s3 import _s3_settings

    d = daemon_factory({**FAST_ICEBERG, "catalog.dsn": pg_catalog_dsn,
                        **_s3_settings(s3_bucket)}, in_process=True).start()
    kw = {"dsn": pg_catalog_dsn, "s3": s3_bucket}
    with Client.connect(d.socket) as c:
        c.send({0: logs_table(0, 0), 1: poison()}, client="bad")
    [location] = wait_table_files(d, "bad", bool, **kw)
    letter, *_ = dead_letters(d)
    assert location == f"s3://{s3_bucket['bucket']}/lake/{letter['key']}"
    [row] = dead_rows(d, "bad", **kw).to_pylist()  # slot 0 landed: not a dead letter
    assert (row["slot"], row["rows"], row["reason"]) == (1, 2, "encode")
    assert read_ipc_stream(row["payload"]).equals(poison())


def test_a_dead_letter_holds_only_the_slots_not_in_the_lake(daemon_factory: Any) -> None:
    """A bundle whose slot 0 lands and slot 1 cannot: the dead letter holds slot 1 only,
    so a replay sends no row twice (it held slot 0 too, and the replay wrote those 50
    rows into the lake again)."""
    d = daemon_factory({**FAST_LAKE, "lake.janitor.grace_s": 0}, in_process=True).start()
    with Client.connect(d.socket) as c:
        c.send({0: logs_table(0, 0), 1: poison()}, client="bad")
    deadline = time.monotonic() + 60
    while not (found := dead_letters(d)):
        assert time.monotonic() < deadline, d.log()[-3000:]
        time.sleep(0.3)
    assert [(x["slot"], x["rows"]) for x in found] == [(1, 2)]
    sent = Counter({("bad", 0): 50})
    wait_for_lake(d, sent)
    out = quiverd_cli("dead-letters", "--config", str(d.config_path), "--replay",
                      str(d.socket))
    assert out.returncode == 0 and "1 dead letters sent again" in out.stdout, out.stderr
    deadline = time.monotonic() + 60
    while [x["key"] for x in dead_letters(d)] in ([], [found[0]["key"]]):
        assert time.monotonic() < deadline, d.log()[-2000:]
        time.sleep(0.3)
    time.sleep(1)  # a replayed slot 0 would have landed by now (files rotate every 0.4 s)
    assert_exactly_once(*lake_contents(d), sent)
