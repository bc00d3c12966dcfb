"""The CLI against a real daemon: send, status, wal dump, segments list, check-config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quiverd.cli import main as cli
from tests.daemon.helpers import stored_bundles, tagged_table


def quiverd(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "quiverd", *args], capture_output=True,
                          text=True, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_send_ipc_and_parquet_files_one_bundle_per_batch(daemon_factory, tmp_path):
    d = daemon_factory({"segment.max_open_duration_ms": 100}, in_process=True).start()
    table = pa.concat_tables([tagged_table(i) for i in range(5)])
    ipc = tmp_path / "t.arrow"
    with pa.ipc.new_file(ipc, table.schema) as w:
        for batch in table.to_batches(max_chunksize=100):
            w.write_batch(batch)
    parquet = tmp_path / "t.parquet"
    pq.write_table(table, parquet, row_group_size=250)
    out = quiverd("send", "--socket", str(d.socket), "--client", "cli", "--json",
                  str(ipc), str(parquet))
    acks = [json.loads(line) for line in out.stdout.splitlines()]
    assert len([a for a in acks if a["file"] == str(ipc)]) == 5  # one bundle per batch
    assert sum(a["rows"] for a in acks if a["file"] == str(parquet)) == table.num_rows
    status = json.loads(quiverd("status", "--socket", str(d.admin_socket), "--json").stdout)
    assert sum(s["acks"] for s in status["shards"]) == len(acks)
    plain = quiverd("status", "--socket", str(d.admin_socket)).stdout
    assert "last_sequence" in plain and "fsyncs" in plain
    assert d.stop() == 0
    rows = sum(b.slots[0].num_rows for b in stored_bundles(d.data_dir).values())
    assert rows == 2 * table.num_rows


def test_send_to_a_missing_socket_fails_clearly(tmp_path):
    f = tmp_path / "t.arrow"
    with pa.ipc.new_file(f, tagged_table(0).schema) as w:
        w.write_table(tagged_table(0))
    proc = quiverd("send", "--socket", str(tmp_path / "nope.sock"), "--client", "x", str(f),
                   check=False)
    assert proc.returncode == 1
    assert f"no quiverd socket at {tmp_path / 'nope.sock'}" in proc.stderr
    assert "hint: is quiverd running" in proc.stderr


def test_kill_9_then_wal_dump_shows_every_acknowledged_bundle(daemon_factory):
    # Segments stay open (long duration, large size): the bundles live only in the WAL.
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 600_000}).start()
    from quiverd.client import Client

    with Client.connect(d.socket) as c:
        acks = c.send_many([tagged_table(i) for i in range(25)], client="w")
    d.kill()
    d.start()
    assert d.status()["shards"][0]["open_bundles"] == 25
    d.kill()
    dump = quiverd("wal", "dump", str(d.data_dir / "shard-0/wal/quiver.wal"), "--json")
    rows = [json.loads(line) for line in dump.stdout.splitlines()]
    entries = [r for r in rows if r["kind"] == "entry"]
    assert {r["sequence"] for r in entries} == {a.sequence for a in acks}
    assert all(r["crc"] == "ok" for r in entries)
    assert rows[0]["kind"] == "header"


def test_segments_list_and_segment_dump(daemon_factory):
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50}, in_process=True).start()
    from quiverd.client import Client

    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(i) for i in range(3)], client="s")
    import time

    time.sleep(0.5)
    rows = json.loads(quiverd("segments", "list", "--socket", str(d.admin_socket),
                              "--json").stdout)
    assert rows and sum(r["bundles"] for r in rows) == 3
    info = json.loads(quiverd("segment", "dump", rows[0]["path"], "--json").stdout)
    assert info
    assert "segment_seq" in quiverd("segments", "list", "--socket", str(d.admin_socket)).stdout


def test_check_config_names_the_bad_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('data_dir = "/tmp/x"\n[wal]\nflush_polcy = "always"\n')
    proc = quiverd("check-config", str(bad), check=False)
    assert proc.returncode == 1
    assert "wal.flush_polcy" in proc.stderr and "unknown key" in proc.stderr
    bad.write_text('data_dir = "/tmp/x"\n[wal]\nflush_policy = "sometimes"\n')
    proc = quiverd("check-config", str(bad), check=False)
    assert "wal.flush_policy" in proc.stderr
    good = quiverd("check-config", "config.toml")
    assert "ok" in good.stdout


def test_send_parquet_cuts_row_groups_to_fit_max_bundle_bytes(daemon_factory, tmp_path):
    limit = 128 * 1024
    d = daemon_factory({"ingest.max_bundle_bytes": limit,
                        "segment.max_open_duration_ms": 100}, in_process=True).start()
    table = pa.concat_tables([tagged_table(i, rows=5000, text_bytes=16) for i in range(6)])
    parquet = tmp_path / "big.parquet"
    pq.write_table(table, parquet, row_group_size=10_000)  # 3 row groups of ~400 KB
    out = quiverd("send", "--socket", str(d.socket), "--client", "cli", str(parquet))
    assert out.returncode == 0, out.stderr
    assert f"{parquet}: 3 row groups -> " in out.stdout
    assert f"3 of them cut to fit the daemon's max_bundle_bytes of {limit} bytes" in out.stdout
    assert d.stop() == 0
    stored = stored_bundles(d.data_dir)
    got = pa.concat_tables([b.slots[0] for _, b in sorted(stored.items())])
    assert got.num_rows == table.num_rows
    assert sorted(got.column("tag").to_pylist()) == sorted(table.column("tag").to_pylist())
    # No bundle spans two row groups: rows of one bundle come from one row group.
    for b in stored.values():
        ids = b.slots[0].column("tag").to_pylist()
        first = b.slots[0].column("i").to_pylist()
        assert len({(t * 5000 + i) // 10_000 for t, i in zip(ids, first, strict=True)}) == 1


def test_send_with_a_bad_client_name_is_one_line_not_a_traceback(daemon_factory, tmp_path):
    d = daemon_factory(in_process=True).start()
    f = tmp_path / "t.arrow"
    with pa.ipc.new_file(f, tagged_table(0).schema) as w:
        w.write_table(tagged_table(0))
    proc = quiverd("send", "--socket", str(d.socket), "--client", "Bad Name", str(f),
                   check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[0] == (
        "quiverd: --client: client name 'Bad Name' must match [A-Za-z0-9._-]{1,255}")
    assert proc.stderr.splitlines()[1].startswith("hint: ")
    assert d.status()["shards"][0]["acks"] + d.status()["shards"][1]["acks"] == 0


def _into_closed_pipe(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run quiverd with stdout a pipe whose reader is already gone: every write fails
    with EPIPE (``| head -1`` does this one time in five, when it exits first)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "quiverd", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60, env=env)
    finally:
        os.close(write_end)


def _like_head_1(args: list[str]) -> subprocess.CompletedProcess:
    """Run quiverd into a reader that takes one line and closes, as ``| head -1``."""
    proc = subprocess.Popen([sys.executable, "-m", "quiverd", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    return subprocess.CompletedProcess(args, proc.wait(60), "", err)


@pytest.mark.parametrize("unbuffered", [True, False])
def test_stdout_reader_gone_exits_quietly_with_141(daemon_factory, tmp_path, unbuffered):
    d = daemon_factory(in_process=True).start()
    f = tmp_path / "t.arrow"
    with pa.ipc.new_file(f, tagged_table(0).schema) as w:
        for i in range(3):
            w.write_table(tagged_table(i))
    admin = ["--socket", str(d.admin_socket)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:  # each print writes at once: EPIPE inside the command, not at exit
        env["PYTHONUNBUFFERED"] = "1"
    for args in (["status", *admin], ["status", "--json", *admin], ["segments", "list", *admin],
                 ["subscribers", "list", *admin],
                 ["send", "--socket", str(d.socket), "--client", "c", "--json", str(f)]):
        proc = _into_closed_pipe(args, env)  # deterministic: once each
        assert (proc.returncode, proc.stderr) == (cli.EXIT_STDOUT_CLOSED, ""), args
    for _ in range(5 if unbuffered else 0):  # the race itself, as the issue saw it
        proc = _like_head_1(["status", *admin])
        assert proc.returncode in (0, cli.EXIT_STDOUT_CLOSED) and proc.stderr == "", proc
    assert d.status()["stopping"] is False
