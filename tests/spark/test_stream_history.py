"""spark.readStream.format("quiver") starts with the lake's rows (issue 29 item 4).

A real daemon with its lake on, real lake files, a real local Spark: rows written and
landed before the query started (their segments collected) are streamed first, then
the rows the daemon still holds and those written later, each exactly once, also when
the query is SIGKILLed mid-batch and restarted from its checkpoint.
"""

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
import pytest

from quiverd.client import Client
from quiverd.lake.model import FileRow
from quiverd.net.admin import request
from quiverd.spark.stream_history import (
    LAKE_THROUGH,
    StreamOffset,
    buffer_ranges,
    in_range,
    lake_end,
    lake_ranges,
)
from tests.daemon.helpers import tagged_table
from tests.daemon.lake_helpers import FAST_LAKE, registered_rows

ROWS = 10  # rows per bundle
SCHEMA = "tag long, i long, s string, _quiver_shard int, _quiver_segment long, " \
         "_quiver_bundle long"
LAKE = {"shards": 2, **FAST_LAKE, "segment.max_open_duration_ms": 50}
ROOT = Path(__file__).resolve().parents[2]


def produce(d: Any, tags: range, client: str = "a") -> None:
    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(t, rows=ROWS) for t in tags], client=client)


def wait_for(predicate: Any, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.1)


def segment_bundles(d: Any) -> int:
    return sum(s["bundles"] for s in request(d.admin_socket, "segments"))


def landed(d: Any, tags: range, client: str = "a", *, collected: bool = True) -> None:
    """Until the lake holds every row of ``tags`` and (``collected``) the daemon's
    segments hold none of them: a stream can then get them only from the lake."""
    want = len(tags) * ROWS
    wait_for(lambda: sum(r.row_count for r in registered_rows(d)
                         if r.client_name == client) >= want, what=f"{want} rows in the lake")
    if collected:
        wait_for(lambda: segment_bundles(d) == 0, what="the landed segments deleted")


def stream(spark: Any, d: Any, subscriber: str, **options: Any) -> Any:
    reader = (spark.readStream.format("quiver").schema(SCHEMA)
              .option("socket", str(d.socket)).option("subscriber", subscriber))
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def run_available(spark: Any, d: Any, subscriber: str, out: Path, ckpt: Path,
                  **options: Any) -> Any:
    q = (stream(spark, d, subscriber, **options).writeStream.format("parquet")
         .option("path", str(out)).option("checkpointLocation", str(ckpt))
         .trigger(availableNow=True).start())
    q.awaitTermination(240)
    assert q.exception() is None, q.exception()
    return q


def sink_rows(spark: Any, out: Path) -> list[tuple[int, int]]:
    """(tag, i) of every row the file sink committed (its _spark_metadata log)."""
    return [(r.tag, r.i) for r in spark.read.parquet(str(out)).select("tag", "i").collect()]


def expect(tags: range) -> list[tuple[int, int]]:
    return sorted((t, i) for t in tags for i in range(ROWS))


def once(got: list[tuple[int, int]]) -> None:
    twice = [k for k, n in Counter(got).items() if n > 1]
    assert not twice, f"{len(twice)} rows delivered twice, e.g. {twice[:5]}"


@pytest.mark.timeout(600)
def test_stream_history_new_query_gets_landed_rows_then_new_ones_exactly_once(
        spark, daemon_factory, tmp_path):
    d = daemon_factory(LAKE).start()
    produce(d, range(500))  # 5,000 rows
    landed(d, range(500))
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    q = run_available(spark, d, "history", out, ckpt)
    got = sink_rows(spark, out)
    once(got)
    assert sorted(got) == expect(range(500))  # before: 0 rows (only segments were read)
    # The lake part was the first batch; it ends at the seam, where the offsets are the
    # buffer's again (no lake_through).
    first = q.recentProgress[0]
    assert first["numInputRows"] == 5000
    assert LAKE_THROUGH not in json.loads(first["sources"][0]["endOffset"])
    # from = "earliest" (Kafka's): only what the segments still hold, none of it.
    run_available(spark, d, "segments-only", tmp_path / "o2", tmp_path / "c2",
                  **{"from": "earliest"})
    assert sink_rows(spark, tmp_path / "o2") == []
    # Rows written later come from the daemon's buffer, after the lake part: once each.
    produce(d, range(500, 560))
    # The query's subscriber holds them: finalized, they stay until it commits them.
    wait_for(lambda: segment_bundles(d) >= 60, what="the new bundles finalized")
    run_available(spark, d, "history", out, ckpt)
    got = sink_rows(spark, out)
    once(got)
    assert sorted(got) == expect(range(560))


@pytest.mark.timeout(600)
def test_stream_history_seam_bundles_in_lake_and_segments_read_once(spark, daemon_factory,
                                                                     tmp_path):
    """Bundles both in the lake and still in segments (another subscriber holds them)
    come from the segments only; the landed, collected ones from the lake only."""
    d = daemon_factory(LAKE).start()
    produce(d, range(200))
    landed(d, range(200))
    request(d.admin_socket, "subscribers.add", {"name": "holder", "start": "latest"})
    produce(d, range(200, 300))
    landed(d, range(300), collected=False)  # in the lake, and held in the segments
    assert segment_bundles(d) == 100
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    q = run_available(spark, d, "seam", out, ckpt)
    got = sink_rows(spark, out)
    once(got)
    assert sorted(got) == expect(range(300))
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert sizes[:2] == [2000, 1000]  # the lake's 200 bundles, then the segments' 100


@pytest.mark.timeout(600)
def test_stream_history_file_across_the_seam_read_in_part(spark, daemon_factory, tmp_path):
    """One lake file holding bundles on both sides of the seam (its first segments
    deleted, its last ones held by another subscriber): the lake part reads only the
    rows at or before the seam, the segments the rest."""
    d = daemon_factory({**LAKE, "lake.file_duration_ms": 4000}).start()
    produce(d, range(20))
    wait_for(lambda: segment_bundles(d) == 20, what="the first 20 bundles finalized")
    request(d.admin_socket, "subscribers.add", {"name": "holder", "start": "latest"})
    produce(d, range(20, 40))  # the same open lake file (4 s), segments after the holder's start
    landed(d, range(40), collected=False)
    wait_for(lambda: segment_bundles(d) == 20, what="the first segments deleted")
    held = min(s["segment_seq"] for s in request(d.admin_socket, "segments"))
    across = [r for r in registered_rows(d)
              if r.first_segment < held <= r.last_segment]
    assert across, "no lake file across the seam: the test proves nothing"
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    q = run_available(spark, d, "across", out, ckpt)
    got = sink_rows(spark, out)
    once(got)
    assert sorted(got) == expect(range(40))
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert sizes[:2] == [200, 200]


@pytest.mark.timeout(600)
def test_stream_history_quarantined_file_fails_lost_file_is_data_loss(spark, daemon_factory,
                                                                      tmp_path):
    """A lake file of the lake part that cannot be read fails the batch naming it, never
    a smaller batch: quarantined (the scrub's verdict), then, once an operator recorded
    it as lost, data loss as for retention's (failOnDataLoss false goes on without it)."""
    import anyio

    from quiverd.kernel.config import load as load_config
    from quiverd.kernel.logs import get as get_logger
    from quiverd.lake.scrub import quarantine_file
    from quiverd.lake.tier import open_tier
    from tests.daemon.lake_helpers import quiverd_cli

    d = daemon_factory({**LAKE, "lake.file_duration_ms": 200}).start()
    for r in range(3):
        produce(d, range(r * 20, r * 20 + 20))
        time.sleep(0.5)
    landed(d, range(60))
    files = sorted(registered_rows(d), key=lambda r: (r.first_segment, r.first_bundle))
    assert len(files) >= 2
    bad = files[0]
    assert d.stop() == 0

    async def quarantine() -> None:  # what the lake scrub does on finding damage
        async with open_tier(load_config(d.config_path), get_logger("test")) as tier:
            assert await quarantine_file(tier, bad, "CRC-32C mismatch (test)")

    anyio.run(quarantine)
    d.start()

    def run(name: str, **options: Any) -> Any:
        q = (stream(spark, d, name, **options).writeStream.format("parquet")
             .option("path", str(tmp_path / name)).option("checkpointLocation",
                                                          str(tmp_path / f"{name}.c"))
             .trigger(availableNow=True).start())
        try:
            q.awaitTermination(120)
        except Exception:  # noqa: BLE001 - q.exception() has it
            pass
        return q

    failed = run("quarantined").exception()
    assert failed is not None and f"lake file {bad.file_id}" in str(failed)
    assert "quarantined" in str(failed)
    assert quiverd_cli("files", "forget", bad.file_id, "--config",
                       str(d.config_path)).returncode == 0
    lost = run("lost").exception()
    assert lost is not None and "data lost" in str(lost) and bad.file_id in str(lost)
    assert 'failOnDataLoss", "false"' in str(lost)
    assert run("gone-on", failOnDataLoss="false").exception() is None
    got = sink_rows(spark, tmp_path / "gone-on")
    once(got)
    assert len(got) == 600 - bad.row_count


@pytest.mark.timeout(600)
def test_stream_history_every_client_one_client_and_from_latest(spark, daemon_factory,
                                                                tmp_path):
    d = daemon_factory(LAKE).start()
    produce(d, range(30), client="a")
    produce(d, range(100, 120), client="b")
    landed(d, range(30), "a")
    landed(d, range(100, 120), "b")
    run_available(spark, d, "every", tmp_path / "every", tmp_path / "every.c")
    every = sink_rows(spark, tmp_path / "every")
    once(every)
    assert sorted(every) == sorted(expect(range(30)) + expect(range(100, 120)))
    run_available(spark, d, "only-b", tmp_path / "b", tmp_path / "b.c", client="b")
    assert sorted(sink_rows(spark, tmp_path / "b")) == expect(range(100, 120))
    # from = "latest" (Kafka's): nothing of what is there, only what comes after.
    run_available(spark, d, "new-only", tmp_path / "new", tmp_path / "new.c",
                  **{"from": "latest"})
    assert sink_rows(spark, tmp_path / "new") == []
    produce(d, range(200, 205), client="a")
    wait_for(lambda: segment_bundles(d) >= 5, what="the new bundles finalized")
    run_available(spark, d, "new-only", tmp_path / "new", tmp_path / "new.c",
                  **{"from": "latest"})
    assert sorted(sink_rows(spark, tmp_path / "new")) == expect(range(200, 205))


@pytest.mark.timeout(600)
def test_stream_history_max_bundles_batches_and_initial_offset_repeats(spark, daemon_factory,
                                                                       tmp_path):
    d = daemon_factory(LAKE).start()
    for r in range(6):  # six rounds, each in lake files of its own (file_duration_ms)
        produce(d, range(r * 50, r * 50 + 50))
        time.sleep(0.6)
    landed(d, range(300))
    files = [r for r in registered_rows(d) if r.client_name == "a"]
    assert len(files) >= 3, files
    from quiverd.spark.stream import QuiverStreamReader, StreamOptions

    opts = StreamOptions.parse({"socket": str(d.socket), "subscriber": "batches"})
    reader = QuiverStreamReader(opts, spark.createDataFrame([], SCHEMA).schema)
    first = reader.initialOffset()
    assert LAKE_THROUGH in first
    reader.stop()
    # Spark asks again when it re-runs the first batch (a restarted driver): the same.
    again = QuiverStreamReader(opts, reader.schema)
    assert again.initialOffset() == first
    again.stop()
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    q = run_available(spark, d, "batches", out, ckpt, maxBundlesPerTrigger=60)
    got = sink_rows(spark, out)
    once(got)
    assert sorted(got) == expect(range(300))
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert len(sizes) >= 3 and sum(sizes) == 3000
    biggest = max(r.bundle_count for r in files)
    assert max(sizes) <= (60 + biggest) * ROWS  # cut at file ends: at most one file over


def read_rows(reader: Any, start: dict[str, Any], end: dict[str, Any]
              ) -> tuple[list[tuple[int, int]], set[str]]:
    """What Spark's tasks of the batch (start, end] read, called as the executors do;
    and the lake files they opened."""
    got: list[tuple[int, int]] = []
    parts = reader.partitions(start, end)
    for p in parts:
        for batch in reader.read(p):
            got += zip(batch.column("tag").to_pylist(), batch.column("i").to_pylist(),
                       strict=True)
    return got, {p.file_id for p in parts if getattr(p, "file_id", "")}


@pytest.mark.timeout(600)
def test_stream_history_batch_replanned_after_compaction_reads_the_same_rows(
        spark_installed, daemon_factory):
    """A batch of the lake part planned again (Spark's re-run from the checkpoint) after
    a compaction replaced its files, their objects deleted: the same rows, from the
    compacted file."""
    from pyspark.sql import types as st
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxFiles

    from quiverd.spark.stream import QuiverStreamReader, StreamOptions
    from tests.daemon.lake_helpers import quiverd_cli, uri_path

    d = daemon_factory({**LAKE, "lake.compaction.min_files": 2,
                        "lake.compaction.delete_grace_s": 0, "lake.janitor.grace_s": 0}).start()
    for r in range(6):
        produce(d, range(r * 50, r * 50 + 50))
        time.sleep(0.6)
    landed(d, range(300))
    uris = {r.file_id: r.uri for r in registered_rows(d)}
    before = set(uris)
    assert len(before) >= 3
    schema = st.StructType([st.StructField("tag", st.LongType()),
                            st.StructField("i", st.LongType())])
    reader = QuiverStreamReader(StreamOptions.parse(
        {"socket": str(d.socket), "subscriber": "compacted"}), schema)
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadMaxFiles(120))
    assert LAKE_THROUGH in end, "one batch took all of the lake part: nothing to re-plan"
    first, opened = read_rows(reader, start, end)
    assert opened <= before and first
    for cmd in ("compact", "janitor"):
        out = quiverd_cli(cmd, "--config", str(d.config_path), "--json")
        assert out.returncode == 0, out.stderr
    after = {r.file_id for r in registered_rows(d)}
    assert after.isdisjoint(opened), "the batch's files were not compacted"
    assert not any(Path(uri_path(uris[f])).exists() for f in opened)  # objects deleted
    again, reopened = read_rows(reader, start, end)
    assert reopened <= after
    assert sorted(again) == sorted(first)
    every = list(first)
    while True:  # the rest of the lake part, then the buffer (nothing): each row once
        nxt = reader.latestOffset(end, ReadAllAvailable())
        if nxt == end:
            break
        every += read_rows(reader, end, nxt)[0]
        end = nxt
    reader.stop()
    once(every)
    assert sorted(every) == expect(range(300))


@pytest.mark.timeout(900)  # two local Sparks in child processes, on a busy machine
def test_stream_history_killed_mid_batch_restarts_exactly_once(spark_installed,
                                                               daemon_factory, tmp_path):
    """The issue's "done when": 5,000 rows written and landed, then a query started: it
    delivers them and the rows written later exactly once, also after a kill -9 of the
    query in the middle of a batch of the lake part."""
    d = daemon_factory(LAKE).start()
    for r in range(10):  # 5,000 rows in ten rounds: several lake files, several batches
        produce(d, range(r * 50, r * 50 + 50))
        time.sleep(0.5)
    landed(d, range(500))
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = [sys.executable, "-m", "tests.spark.stream_child", str(d.socket), "killed",
            str(ckpt), str(out)]
    child = subprocess.Popen([*args, "forever", "50"], cwd=ROOT)
    commits, offsets = ckpt / "commits", ckpt / "offsets"

    def logged(directory: Path) -> list[int]:
        return sorted(int(p.name) for p in directory.glob("[0-9]*")) if directory.exists() \
            else []

    try:
        def mid_batch() -> bool:
            # Inside a batch of the lake part: its offsets are logged (with the seam),
            # its commit is not, so the restart must re-run exactly that range.
            done, planned = logged(commits), logged(offsets)
            return (len(done) >= 2 and len(planned) > len(done)
                    and LAKE_THROUGH in (offsets / str(planned[-1])).read_text())

        wait_for(mid_batch, timeout=300, what="a lake batch under way after 2 committed")
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    assert len(logged(commits)) < len(logged(offsets)), "killed between batches"
    produce(d, range(500, 540))  # more while it is down
    wait_for(lambda: segment_bundles(d) >= 40, what="the new bundles finalized")
    again = subprocess.run([*args, "available", "50"], cwd=ROOT, timeout=600)
    assert again.returncode == 0
    got = [tuple(row) for row in json.loads((tmp_path / "out.rows.json").read_text())]
    once(got)
    assert sorted(got) == expect(range(540))


# ---- the plan's pieces, no Spark, no daemon ---------------------------------------------

END = 0xFFFF_FFFF


def row(shard: int, first: tuple[int, int], last: tuple[int, int], bundles: int,
        name: str = "f") -> FileRow:
    return FileRow(file_id=f"{name}{shard}{first}{last}", client_name="a", shard=shard,
                   first_segment=first[0], first_bundle=first[1], last_segment=last[0],
                   last_bundle=last[1], bundle_count=bundles)


def test_stream_history_offsets_old_form_seam_dropped_past_it():
    old = {"0": [3, 7], "1": [0, -1]}
    assert StreamOffset.parse(old).json() == old  # checkpoints from before: unchanged
    assert not StreamOffset.parse(old).in_lake()
    begin = StreamOffset(positions={0: (0, -1), 1: (0, -1)}, seam={0: (5, -1), 1: (0, -1)})
    assert begin.json() == {"0": [0, -1], "1": [0, -1],
                            LAKE_THROUGH: {"0": [5, -1], "1": [0, -1]}}
    assert StreamOffset.parse(begin.json()) == begin
    assert begin.buffer() == {"0": [5, -1], "1": [0, -1]}
    done = StreamOffset(positions={0: (5, -1), 1: (0, -1)}, seam=begin.seam)
    assert done.json() == {"0": [5, -1], "1": [0, -1]}  # past the seam: the buffer's form


def test_stream_history_ranges_split_at_the_seam():
    seam = {0: (5, 2), 1: (0, -1)}
    start = StreamOffset(positions={0: (0, -1), 1: (0, -1)}, seam=seam)
    mid = StreamOffset(positions={0: (3, END), 1: (0, -1)}, seam=seam)
    assert lake_ranges(start, mid) == {0: ((0, -1), (3, END))}
    assert buffer_ranges(start, mid) == {}
    at_seam = StreamOffset.parse(StreamOffset(positions=dict(seam), seam=seam).json())
    assert lake_ranges(mid, at_seam) == {0: ((3, END), (5, 2))}
    assert buffer_ranges(mid, at_seam) == {}
    later = StreamOffset.parse({"0": [9, END], "1": [2, 4]})
    assert lake_ranges(at_seam, later) == {}
    assert buffer_ranges(at_seam, later) == {0: ((5, 2), (9, END)), 1: ((0, -1), (2, 4))}


def test_stream_history_lake_end_cuts_at_file_ends():
    seam = {0: (9, -1), 1: (4, -1)}
    start = StreamOffset(positions={0: (0, -1), 1: (0, -1)}, seam=seam)
    rows = [row(0, (1, 0), (2, 5), 30, "a"), row(0, (2, 6), (4, 1), 30, "b"),
            row(0, (1, 2), (6, 0), 10, "c"),  # out of order: interleaves a and b
            row(0, (9, 0), (9, 8), 20, "after-seam"), row(1, (1, 0), (3, 9), 50)]
    assert lake_end(rows, start, 0).positions == seam  # no limit: all of it at once
    one = lake_end(rows, start, 25)
    assert one.positions == {0: (2, 5), 1: (0, -1)}  # one file, though over the limit
    two = lake_end(rows, one, 35)
    assert two.positions == {0: (6, 0), 1: (0, -1)}  # b and c: 40 bundles
    three = lake_end(rows, two, 35)
    assert three.positions == {0: (9, -1), 1: (3, 9)}  # shard 0 done, then shard 1's file
    assert lake_end(rows, three, 35).json() == {"0": [9, -1], "1": [4, -1]}


def test_stream_history_in_range_compares_segment_and_bundle_as_a_pair():
    batch = pa.record_batch({"_quiver_segment": pa.array([1, 2, 2, 2, 3, 3], pa.int64()),
                             "_quiver_bundle": pa.array([9, 0, 4, 5, 0, 1], pa.int64())})
    keep = in_range(batch, (2, 0), (3, 0)).to_pylist()
    assert keep == [False, False, True, True, True, False]
    assert in_range(batch, (0, -1), (2, END)).to_pylist() == [True] * 4 + [False] * 2
    assert in_range(batch, (2, -1), (2, 4)).to_pylist() == [False, True, True] + [False] * 3


def test_stream_history_driver_without_the_data_dir_refused_saying_what_to_do(tmp_path):
    from quiverd.kernel.errors import ConfigError
    from quiverd.spark.stream_history import _source_id

    with pytest.raises(ConfigError, match=r"needs the daemon's data_dir .*/elsewhere on the "
                       "query's driver") as caught:
        _source_id(tmp_path / "elsewhere")
    assert 'option("from", "earliest")' in caught.value.hint
    assert _source_id(tmp_path) == ""  # its lake never ran: no file of it exists
    (tmp_path / "lake.id").write_text("01JABCDEFGHJKMNPQRSTVWXYZ0\n")
    assert _source_id(tmp_path) == "01JABCDEFGHJKMNPQRSTVWXYZ0"


def test_stream_history_source_id_comes_from_the_daemon_not_the_drivers_disk(
        daemon_factory, monkeypatch):
    """JOB lake says the daemon's lake source (its lake.id, read when asked): a driver on
    another host (here: one that cannot read the data_dir) still gets the lake part."""
    from quiverd.spark import stream_history
    from quiverd.spark.stream_history import LakeSide

    d = daemon_factory(LAKE).start()
    with Client.connect(d.socket) as c:
        c.send(tagged_table(1), client="h")
        deadline = time.monotonic() + 30
        while not (d.data_dir / "lake.id").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        info = c.lake_info()
    assert info["source_id"] == (d.data_dir / "lake.id").read_text().strip() != ""

    def elsewhere(data_dir: Path) -> str:
        raise AssertionError("the driver read the data_dir")

    monkeypatch.setattr(stream_history, "_source_id", elsewhere)
    side = LakeSide.open(str(d.socket), "")
    assert side is not None and side.source_id == info["source_id"]
    side = LakeSide.open(str(d.socket), str(d.config_path))  # a named config asks too
    assert side is not None and side.source_id == info["source_id"]
    assert d.stop() == 0
