"""kill -9 at every step of a gc deletion: the next start and fsck see a deletion, not loss.

A batch is deleted in steps (actors/quiverd_actors/gc_sweeper.py): DELETED marker
(tmp → fsync → rename → fsync dir) → unlink each file → fsync the directory →
SEGMENT_DELETED records in ack.log. The ``gc`` fault hook kills the daemon right after
each step; the restart must report no ``bundles_lost`` and ``quiverd fsck`` exit 0.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from tests.daemon.test_subscribers import add, announced, consume, produce, wait_for

STEPS = ["marker_tmp_written", "marker_tmp_fsynced", "marker_renamed", "marker_dir_fsynced",
         "unlinked_first", "unlinked", "dir_fsynced"]


def fsck(d: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "quiverd", "fsck", str(d.data_dir)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("step", STEPS)
def test_kill_9_at_each_gc_deletion_step_reports_no_loss(daemon_factory: Any, step: str) -> None:
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50})
    d.start(faults=f"gc=kill:{step}")
    add(d, "a")
    for batch in range(3):  # three segments, deleted in one batch once "a" acked them all
        produce(d, [batch * 10 + i for i in range(4)])
        wait_for(lambda n=batch: announced(d) == n + 1)
    consume(d, "a", want=12, idle_s=1.0)
    assert d.wait(10) == -9, "the gc never reached step " + step
    d.start()
    # Before the marker's rename the restart finds the segments and their acks, and its gc
    # sweeper deletes them after the start (the clean-clone suite saw 1 left at once).
    wait_for(lambda: d.status()["shards"][0]["segments"] == 0, timeout=30.0)
    produce(d, [100])  # a sequence after the deleted ones: never reused
    assert d.stop() == 0, d.log()[-3000:]
    assert not d.events("bundles_lost"), d.events("bundles_lost")
    done = fsck(d)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LOST" not in done.stdout
