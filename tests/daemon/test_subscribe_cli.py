"""`quiverd subscribers add/remove/list` and `quiverd subscribe` as subprocesses, real daemon."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa

from quiverd.client.producer import Client, TxnTag
from quiverd.kernel.jobs import Winner
from tests.daemon.helpers import tagged_table

FAST = {"segment.max_open_duration_ms": 100}


def quiverd(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "quiverd", *args], capture_output=True,
                          text=True, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def admin(d: Any, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return quiverd("subscribers", *args, "--socket", str(d.admin_socket), check=check)


def listed(d: Any) -> dict[str, dict[str, int]]:
    rows = json.loads(admin(d, "list", "--json").stdout)
    return {r["name"]: r for r in rows}


def consume(d: Any, name: str, *args: str, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
    return quiverd("subscribe", name, "--socket", str(d.socket), *args, check=check)


def json_lines(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.stdout.splitlines()]


def produce(d: Any, tags: list[int], client: str = "p") -> None:
    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(t, rows=10 + t % 7) for t in tags], client=client)


def wait_for(predicate: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def segments(d: Any) -> list[dict[str, Any]]:
    """Finalized segments; ack.log has recorded each one before it is listed."""
    rows = quiverd("segments", "list", "--socket", str(d.admin_socket), "--json").stdout
    return json.loads(rows)


def finalized_bundles(d: Any) -> int:
    return sum(s["bundles"] for s in segments(d))


def test_subscribers_add_list_remove_shows_lag_and_remove_releases_segments(daemon_factory):
    d = daemon_factory({"shards": 1, **FAST}, in_process=True).start()
    out = admin(d, "add", "keeper").stdout
    assert "'keeper' added from earliest on 1 shard" in out
    admin(d, "add", "slow", "--from", "latest")
    produce(d, list(range(6)))
    wait_for(lambda: finalized_bundles(d) == 6)

    subs = listed(d)
    assert set(subs) == {"keeper", "slow"}
    for row in subs.values():
        assert row["lag_bundles"] == 6 and row["lag_segments"] >= 1 and row["lag_bytes"] > 0
        assert row["dropped_bundles"] == 0
    plain = admin(d, "list").stdout
    assert "lag_bundles" in plain and "keeper" in plain and "slow" in plain

    assert len(json_lines(consume(d, "keeper", "--count", "6", "--json"))) == 6
    wait_for(lambda: listed(d)["keeper"]["lag_bundles"] == 0)
    time.sleep(1.5)  # more than a gc sweep: "slow" still holds every segment
    assert len(segments(d)) >= 1
    assert listed(d)["slow"]["lag_bundles"] == 6

    assert "'slow' removed" in admin(d, "remove", "slow").stdout
    wait_for(lambda: not segments(d))
    assert set(listed(d)) == {"keeper"}
    assert d.stop() == 0


def test_subscribers_bad_requests_exit_1_with_message_and_hint(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    bad = admin(d, "add", "Bad Name!", check=False)
    assert bad.returncode == 1
    assert "invalid subscriber name 'Bad Name!'" in bad.stderr
    assert "hint: subscriber names are 1-64 chars" in bad.stderr
    assert admin(d, "add", "x" * 65, check=False).returncode == 1

    admin(d, "add", "twice")
    again = admin(d, "add", "twice", check=False)
    assert again.returncode == 1 and "hint:" in again.stderr
    gone = admin(d, "remove", "nobody", check=False)
    assert gone.returncode == 1 and "nobody" in gone.stderr
    assert "(no subscribers" not in admin(d, "list").stdout
    admin(d, "remove", "twice")
    assert "(no subscribers" in admin(d, "list").stdout
    assert d.stop() == 0


def test_subscribe_count_json_receives_exactly_the_produced_bundles(daemon_factory):
    d = daemon_factory({"shards": 2, **FAST}, in_process=True).start()
    admin(d, "add", "counter")
    for client in ("alpha", "beta", "gamma"):  # clients hash to shards: use both
        produce(d, list(range(4)), client=client)

    lines = json_lines(consume(d, "counter", "--count", "12", "--json", "--window", "5"))
    assert len(lines) == 12
    ids = {(r["shard"], r["segment_seq"], r["bundle_index"]) for r in lines}
    assert len(ids) == 12
    assert Counter(r["client"] for r in lines) == {"alpha": 4, "beta": 4, "gamma": 4}
    assert sum(r["rows"] for r in lines) == 3 * sum(10 + t % 7 for t in range(4))
    assert all(r["slots"] == {"0": r["rows"]} and r["txn"] is None for r in lines)

    wait_for(lambda: listed(d)["counter"]["lag_bundles"] == 0)
    short = consume(d, "counter", "--count", "1", "--timeout", "1", check=False)
    assert short.returncode == 1
    assert "only 0 of 1 bundles arrived" in short.stderr and "hint:" in short.stderr
    assert d.stop() == 0


def test_subscribe_out_writes_durable_files_equal_to_the_sent_tables(daemon_factory, tmp_path):
    d = daemon_factory({"shards": 2, **FAST}, in_process=True).start()
    admin(d, "add", "files")
    sent: dict[int, dict[int, pa.Table]] = {}
    with Client.connect(d.socket) as c:
        for tag in range(5):
            slots = {0: tagged_table(tag, rows=20), 3: tagged_table(1000 + tag, rows=3)}
            sent[tag] = slots
            txn = TxnTag(job_id="job", partition=tag, attempt=0, row_offset=0)
            c.send(slots, client=f"w{tag}", txn=txn)
            # Staged until committed (SPEC §7); a bundle counts every slot's rows.
            c.end_partition("job", tag, 0, client=f"w{tag}", rows=23, checksum=tag)
        c.commit_job("job", [Winner(partition=t, attempt=0, rows=23, checksum=t)
                             for t in range(5)])

    out = tmp_path / "out"
    proc = consume(d, "files", "--out", str(out), "--timeout", "2", "--json")
    lines = json_lines(proc)
    assert len(lines) == 5
    assert "acked 5 bundles" in proc.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 10 and not [f for f in files if f.endswith(".tmp")]
    for line in lines:
        stem = f"{line['shard']}-{line['segment_seq']}-{line['bundle_index']}"
        assert line["files"] == [str(out / f"{stem}.slot0.arrow"),
                                 str(out / f"{stem}.slot3.arrow")]
        tables = {k: pa.ipc.open_file(Path(f)).read_all()
                  for k, f in zip((0, 3), line["files"], strict=True)}
        tag = tables[0]["tag"][0].as_py()
        assert line["client"] == f"w{tag}" and line["txn"]["partition"] == tag
        assert tables[0].equals(sent[tag][0]) and tables[3].equals(sent[tag][3])
    wait_for(lambda: listed(d)["files"]["lag_bundles"] == 0)
    assert d.stop() == 0


def test_subscribe_from_latest_sees_only_new_data_from_earliest_everything(daemon_factory):
    d = daemon_factory({"shards": 2, **FAST}, in_process=True).start()
    produce(d, list(range(5)), client="before")
    wait_for(lambda: finalized_bundles(d) == 5)  # "latest" starts after finalized segments
    # "early" first: a lone "latest" subscriber's mark would cover (and so release for
    # deletion) every segment retained so far.
    admin(d, "add", "early", "--from", "earliest")
    admin(d, "add", "late", "--from", "latest")
    produce(d, list(range(3)), client="after")

    late = json_lines(consume(d, "late", "--count", "3", "--json"))
    assert Counter(r["client"] for r in late) == {"after": 3}
    early = json_lines(consume(d, "early", "--count", "8", "--json"))
    assert Counter(r["client"] for r in early) == {"before": 5, "after": 3}

    wait_for(lambda: listed(d)["late"]["lag_bundles"] == 0)
    assert consume(d, "late", "--count", "1", "--timeout", "1", check=False).returncode == 1
    assert d.stop() == 0


def test_subscribe_unknown_subscriber_exits_1_with_a_clear_error(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    proc = consume(d, "nobody", "--count", "1", check=False)
    assert proc.returncode == 1
    assert "no subscriber named 'nobody'" in proc.stderr
    assert "hint: see the registered names with `quiverd subscribers list`" in proc.stderr
    assert d.stop() == 0


def test_subscribe_without_a_daemon_exits_1_with_a_clear_error(tmp_path):
    proc = quiverd("subscribe", "x", "--socket", str(tmp_path / "nope.sock"), "--count", "1",
                   check=False)
    assert proc.returncode == 1
    assert f"no quiverd socket at {tmp_path / 'nope.sock'}" in proc.stderr
    assert "hint: is quiverd running" in proc.stderr


def test_subscribe_sigint_stops_cleanly_with_exit_130(daemon_factory, tmp_path):
    d = daemon_factory({"shards": 1, **FAST}, in_process=True).start()
    admin(d, "add", "tail")
    proc = subprocess.Popen(
        [sys.executable, "-m", "quiverd", "subscribe", "tail", "--config", str(d.config_path),
         "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: d.events("subscriber_attached"))
        produce(d, [1, 2])
        assert proc.stdout is not None
        first = [proc.stdout.readline(), proc.stdout.readline()]
        assert all("client=p" in line and "files=1" in line for line in first)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130
    assert "acked 2 bundles" in err and "Traceback" not in err
    wait_for(lambda: listed(d)["tail"]["lag_bundles"] == 0)
    assert d.stop() == 0


def test_subscribe_out_write_failure_exits_1_and_the_bundle_is_redelivered(daemon_factory,
                                                                           tmp_path):
    d = daemon_factory({"shards": 1, **FAST}, in_process=True).start()
    admin(d, "add", "probe")
    admin(d, "add", "retry")
    produce(d, [1, 2, 3])
    # Bundle ids are the same for every subscriber: learn them from another one.
    ids = [f"{r['shard']}-{r['segment_seq']}-{r['bundle_index']}"
           for r in json_lines(consume(d, "probe", "--count", "3", "--json"))]
    out = tmp_path / "out"
    blocker = out / f"{ids[1]}.slot0.arrow.tmp"
    blocker.mkdir(parents=True)  # atomic_write cannot create its tmp file over a directory

    failed = consume(d, "retry", "--out", str(out), "--timeout", "2", check=False)
    assert failed.returncode == 1
    assert f"cannot write {out / ids[1]}.slot0.arrow" in failed.stderr
    assert "was not acked and is delivered again" in failed.stderr
    assert failed.stdout.startswith(f"{ids[0]}  client=p")
    blocker.rmdir()
    wait_for(lambda: listed(d)["retry"]["lag_bundles"] == 2)  # the first ack is durable

    again = consume(d, "retry", "--out", str(out), "--timeout", "2")
    assert [line.split()[0] for line in again.stdout.splitlines()] == ids[1:]
    assert sorted(p.name for p in out.iterdir()) == [f"{i}.slot0.arrow" for i in ids]
    assert d.stop() == 0


def test_subscribe_daemon_shutdown_exits_1_saying_the_subscription_ended(daemon_factory,
                                                                         tmp_path):
    d = daemon_factory(FAST, in_process=True).start()
    admin(d, "add", "tail")
    proc = subprocess.Popen(
        [sys.executable, "-m", "quiverd", "subscribe", "tail", "--socket", str(d.socket),
         "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: d.events("subscriber_attached"))
        assert d.stop() == 0
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1
    assert "quiverd is shutting down; the subscription ended" in err
    assert "hint: bundles not acked are delivered again" in err
