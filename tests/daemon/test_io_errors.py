"""I/O errors that cannot be made real on demand, injected with $QUIVERD_FAULTS.

- A failed fsync anywhere, or an I/O error whose effect on disk is unknown, stops the
  daemon the documented way: one ``quiverd_fatal_durability`` event, exit 70, no
  traceback; the restart recovers every acknowledged bundle.
- A segment (or FLOOR) write that fails before its rename, a WAL write or a sidecar
  write that finds no space: retried, the daemon keeps running, nothing is lost.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

import pytest

from quiverd.client import Client
from quiverd.kernel.errors import DurabilityLost
from quiverd.runtime import serve as daemon
from tests.daemon.helpers import stored_bundles, tagged_table
from tests.daemon.test_metrics import scrape

# A WAL of two 32 KiB files: rotations and whole-file releases within a few dozen bundles.
SMALL_WAL = {"shards": 1, "ingest.max_bundle_bytes": 65536, "wal.max_entry_bytes": 131072,
             "wal.max_chunks": 2, "wal.max_size_bytes": 65536,
             "segment.max_open_duration_ms": 50}

FATAL = [
    "wal.write=eio@5",  # a WAL write: EIO
    "wal.fdatasync=eio@3",  # the WAL's fdatasync
    "wal.rotate_dir_fsync=eio@1",  # the directory fsync after a rotation
    "wal.sidecar_tmp_fsynced=eio@1",  # the sidecar's fsync
    "wal.sidecar_dir_fsynced=eio@1",  # the directory fsync after the sidecar's rename
    "wal.unlink_dir_fsync=eio@1",  # the directory fsync after released files are deleted
    "finalize.dir_fsynced=eio@1",  # a segment renamed into place, its directory fsync fails
    "finalize.floor_dir_fsynced=eio@1",  # the same for FLOOR
    "acklog.fdatasync=eio@1",  # ack.log's fdatasync
]


def send_until_gone(d: Any, count: int, *, pause_every: int = 10) -> dict[tuple[int, int], int]:
    """Send ``count`` bundles one by one (each waits for its ack); stop at the first error."""
    acked: dict[tuple[int, int], int] = {}
    try:
        with Client.connect(d.socket) as c:
            for tag in range(count):
                ack = c.send(tagged_table(tag), client="f")
                acked[(ack.shard, ack.sequence)] = tag
                if tag % pause_every == pause_every - 1:
                    time.sleep(0.06)  # let a segment seal by age: finalize, release
    except Exception:
        pass  # the daemon stopped under us: what was acked is what counts
    return acked


def first_event(d: Any, name: str, timeout_s: float = 20) -> dict[str, Any]:
    """The first ``name`` event of the daemon's log, once it is there."""
    deadline = time.monotonic() + timeout_s
    while not (events := d.events(name)):
        assert time.monotonic() < deadline, f"no {name} event:\n{d.log()[-3000:]}"
        time.sleep(0.05)
    return events[0]


def assert_all_stored(data_dir: Path, acked: dict[tuple[int, int], int]) -> None:
    stored = stored_bundles(data_dir)  # asserts no bundle is stored twice
    missing = [k for k in acked if k not in stored]
    assert not missing, f"{len(missing)} acknowledged bundles lost, e.g. {missing[:5]}"
    for key, tag in acked.items():
        assert stored[key].slots[0].equals(tagged_table(tag)), key


@pytest.mark.parametrize("fault", FATAL)
def test_io_error_is_fatal_with_exit_70_and_restart_recovers_acked(daemon_factory, fault):
    d = daemon_factory(SMALL_WAL).start(faults=fault)
    acked = send_until_gone(d, 300)
    assert d.wait(30) == daemon.EXIT_FATAL, d.log()[-3000:]
    [fatal] = d.events("quiverd_fatal_durability")
    assert "injected" in fatal["error"] and fatal["hint"], fatal
    # Which file failed, always: an fsync by fd raises with no filename of its own.
    assert fatal.get("path", "").startswith(str(d.data_dir / "shard-0")), fatal
    assert fatal["errno"] == "EIO", fatal
    assert "Traceback" not in d.log()
    d.start()  # no faults now
    assert d.stop() == 0
    assert_all_stored(d.data_dir, acked)


def test_unexpected_os_error_at_startup_is_reported_not_a_traceback(daemon_factory):
    d = daemon_factory({"shards": 1})
    (d.data_dir / "shard-0").mkdir(parents=True)
    (d.data_dir / "shard-0" / "segments").write_bytes(b"not a directory")
    d.start(wait=False)
    assert d.wait(30) == daemon.EXIT_FATAL
    [fatal] = d.events("quiverd_fatal_durability")
    assert fatal["unexpected"] is True and fatal["errno"] == "EEXIST"
    assert "segments" in fatal["path"]
    assert "Traceback" not in d.log()


@pytest.mark.parametrize("group", [
    BaseExceptionGroup("x", [OSError(errno.EIO, "boom", "/d/f")]),
    BaseExceptionGroup("x", [ExceptionGroup("y", [DurabilityLost("gone")])]),
])
def test_report_fatal_maps_io_errors_to_the_durability_exit(group):
    events: list[tuple[str, dict[str, Any]]] = []

    class Log:
        def critical(self, event: str, **kw: Any) -> None:
            events.append((event, kw))

    assert daemon._report_fatal(group, Log()) == daemon.EXIT_FATAL
    [(event, fields)] = events
    assert event == "quiverd_fatal_durability" and fields["hint"]


@pytest.mark.parametrize("fault,errname", [("finalize.tmp_written=eio@1-3", "EIO"),
                                           ("finalize.tmp_written=enospc@1-2", "ENOSPC"),
                                           ("finalize.tmp_fsynced=eio@1", "EIO"),
                                           ("finalize.floor_tmp_written=enospc@1", "ENOSPC")])
def test_segment_write_failure_is_retried_and_daemon_keeps_running(daemon_factory, fault,
                                                                   errname):
    d = daemon_factory({**SMALL_WAL, "metrics.listen": "127.0.0.1:0"},
                       in_process=True).start(faults=fault)
    listening = first_event(d, "metrics_listening")
    acked = send_until_gone(d, 60)
    assert len(acked) == 60
    first_event(d, "segment_write_recovered")
    failed = d.events("segment_write_failed")
    assert failed and failed[0]["errno"] == errname and failed[0]["hint"]
    samples = scrape(listening["address"])
    assert samples["quiver_segment_write_failures_total"][(("shard", "0"),)] >= 1
    if errname == "ENOSPC":
        assert samples["quiver_disk_full_total"][(("file", "segment"), ("shard", "0"))] >= 1
    assert d.running
    assert d.stop() == 0
    assert not d.events("quiverd_fatal_durability") and "Traceback" not in d.log()
    assert_all_stored(d.data_dir, acked)
    assert not list((d.data_dir / "shard-0" / "segments").glob("*.tmp"))


def test_wal_write_without_space_is_held_then_written_with_contiguous_sequences(daemon_factory):
    d = daemon_factory(SMALL_WAL, in_process=True).start(faults="wal.write=enospc@3-6")
    acked = send_until_gone(d, 40)
    assert len(acked) == 40
    assert d.stop() == 0
    assert [e["reason"] for e in d.events("wal_disk_full")] == ["enospc"]
    [back] = d.events("wal_disk_space_back")
    assert back["failures"] == 4
    assert sorted(s for _, s in acked) == list(range(1, 41))
    assert_all_stored(d.data_dir, acked)


def test_sidecar_without_space_defers_the_release(daemon_factory):
    d = daemon_factory(SMALL_WAL, in_process=True)
    d.start(faults="wal.sidecar_tmp_written=enospc@1-2")
    acked = send_until_gone(d, 80)
    assert len(acked) == 80
    first_event(d, "wal_release_done")
    assert d.events("wal_release_deferred")
    assert d.stop() == 0
    assert "Traceback" not in d.log()
    assert_all_stored(d.data_dir, acked)
