"""Start on a 100 % full data filesystem, the cases beyond tests/daemon/test_disk_full_acks.py:
a torn WAL tail whose copy into quarantine/ finds no space, and a shard whose ack.log
does not exist yet. For real (tmpfs, root only). Each time the daemon starts, serves a
drain, and takes writes once space returns; no byte is dropped without a copy.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from quiverd.client import Client
from quiverd.net.connection import shard_of
from tests.daemon.helpers import tagged_table
from tests.daemon.mounts import MiB, fill, mounted_tmpfs
from tests.daemon.test_subscribers import add, consume, produce, wait_for

# A partial entry: its length says 4000 bytes, the file ends 60 bytes later.
TORN = (4000).to_bytes(4, "little") + b"\x00" + bytes(range(1, 56))


def subscribe_in_config(d: Any) -> None:
    with open(d.config_path, "a") as f:
        f.write('\n[[subscribers]]\nname = "sub"\nstart = "earliest"\n')


def tags(bundles: list[Any]) -> list[int]:
    return sorted(b.tables[0].column("tag")[0].as_py() for b in bundles)


def test_start_on_a_full_disk_with_a_torn_wal_tail_defers_the_cut(
        daemon_factory: Any, short_dir: Path) -> None:
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50})
    with mounted_tmpfs(d.data_dir, 64 * MiB):
        d.start()
        add(d, "sub")
        produce(d, [1, 2, 3])
        wait_for(lambda: d.status()["shards"][0]["segments"] >= 1)
        time.sleep(0.3)  # in a segment: a full disk has no room to write one at start
        d.kill()
        wal = d.data_dir / "shard-0/wal/quiver.wal"
        good_end = wal.stat().st_size
        with open(wal, "ab") as f:
            f.write(TORN)
        ballast = d.data_dir / "ballast"
        fill(ballast)
        assert os.statvfs(d.data_dir).f_bavail == 0
        d.start()
        [deferred] = d.events("wal_torn_tail_deferred")
        assert deferred["offset"] == good_end and deferred["bytes"] == len(TORN)
        assert wal.read_bytes()[good_end:] == TORN  # kept where it was, not dropped
        assert tags(consume(d, "sub", want=3)) == [1, 2, 3]
        assert d.proc is not None and d.proc.poll() is None, d.log()[-3000:]
        ballast.unlink()
        with Client.connect(d.socket) as c:
            c.send(tagged_table(4), client="p")  # the first write cuts the tail, then lands
        [cut] = d.events("wal_torn_tail")
        assert cut["offset"] == good_end
        assert Path(cut["quarantine"]).read_bytes() == TORN
        assert wal.read_bytes()[good_end:good_end + len(TORN)] != TORN
        assert d.stop() == 0, d.log()[-3000:]
        d.start()
        assert tags(consume(d, "sub", want=2, idle_s=1.5)) == [4]
        assert d.stop() == 0
        assert not d.events("bundles_lost") and not d.events("quiverd_fatal_durability")
        assert not d.events("wal_damage_skipped")


def test_start_on_a_full_disk_with_a_new_shard_without_ack_log(
        daemon_factory: Any, short_dir: Path) -> None:
    """Two shards, the second never started (no WAL, no ack.log yet) on a full disk."""
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50}, in_process=True)
    with mounted_tmpfs(d.data_dir, 64 * MiB):
        subscribe_in_config(d)
        d.start()
        produce(d, [1, 2, 3])
        wait_for(lambda: d.status()["shards"][0]["segments"] >= 1)
        assert d.stop() == 0
        ballast = d.data_dir / "ballast"
        fill(ballast)
        assert os.statvfs(d.data_dir).f_bavail == 0
        d.settings["shards"] = 2  # shard-1 is new: its directory and ack.log do not exist
        d._write_config()
        subscribe_in_config(d)  # every shard registers it, the new one too
        d.start()
        assert d.running, d.log()[-3000:]
        assert d.events("wal_header_deferred") and d.events("ack_log_compaction_deferred")
        new_shard = d.data_dir / "shard-1"
        assert (new_shard / "ack.log").stat().st_size == 0  # created empty, no header yet
        assert tags(consume(d, "sub", want=3)) == [1, 2, 3]
        ballast.unlink()
        clients = {shard_of(f"p{t}", 2): f"p{t}" for t in range(10)}
        with Client.connect(d.socket) as c:
            for t in range(10, 20):  # both shards take writes again
                c.send(tagged_table(t), client=clients[t % 2])
        time.sleep(0.3)
        assert d.stop() == 0, d.log()[-3000:]
        assert (new_shard / "wal/quiver.wal").stat().st_size > 30
        assert (new_shard / "ack.log").stat().st_size > 0
        d.start()
        assert tags(consume(d, "sub", want=11, idle_s=1.5)) == list(range(10, 20))
        assert d.stop() == 0
        assert not d.events("bundles_lost") and not d.events("quiverd_fatal_durability")


def holes(path: Path) -> list[tuple[int, int]]:
    """The file's holes (start, end), from SEEK_HOLE/SEEK_DATA."""
    out: list[tuple[int, int]] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size, pos = os.fstat(fd).st_size, 0
        while pos < size:
            start = os.lseek(fd, pos, os.SEEK_HOLE)
            if start >= size:
                break
            try:
                pos = os.lseek(fd, start, os.SEEK_DATA)
            except OSError:  # ENXIO: a hole up to the end
                pos = size
            out.append((start, pos))
    finally:
        os.close(fd)
    return out


def test_start_on_a_full_tmpfs_with_a_punched_wal_and_no_sidecar_maps_no_hole(
        daemon_factory: Any, short_dir: Path) -> None:
    """Without the sidecar replay walks the WAL from its header, into the punched prefix.
    Reading a hole through a memory map makes tmpfs allocate a page: on a full tmpfs
    that is SIGBUS, at every start (issue 17). Replay must step over holes unread."""
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50})
    with mounted_tmpfs(d.data_dir, 64 * MiB):
        subscribe_in_config(d)
        d.start()
        produce(d, list(range(100)))
        wait_for(lambda: d.status()["shards"][0]["segments"] >= 1)
        time.sleep(0.5)  # the segment is durable: the WAL's prefix is punched
        produce(d, list(range(100, 110)))
        d.kill()
        wal = d.data_dir / "shard-0/wal/quiver.wal"
        assert holes(wal), "no hole punched: the test proves nothing"
        (d.data_dir / "shard-0/wal/truncate.offset").unlink()
        ballast = d.data_dir / "ballast"
        fill(ballast)
        assert os.statvfs(d.data_dir).f_bavail == 0
        d.start()
        assert d.proc is not None and d.proc.poll() is None, d.log()[-3000:]
        [skipped] = d.events("wal_holes_skipped")
        assert skipped["resumed_at"] == holes(wal)[-1][1]
        assert tags(consume(d, "sub", want=100)) == list(range(100))
        ballast.unlink()  # the live entries after the hole were replayed: their segment
        assert tags(consume(d, "sub", want=10)) == list(range(100, 110))
        assert d.stop() == 0, d.log()[-3000:]
        assert not d.events("bundles_lost") and not d.events("quiverd_fatal_durability")
