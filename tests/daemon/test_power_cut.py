"""Power cut, for real: ``xfs_io -x -c shutdown`` on a loop-mounted xfs image mid-stream.

xfs shutdown without a log flush behaves like losing power: writes not yet synced
vanish, fdatasynced ones stay (ext4 on a loop device does not reliably keep even
those, see NOTES.md, so the harness is xfs). Producers send continuously and record
every ack; at a random moment the filesystem goes down; the daemon hits EIO and must
stop the documented way (exit 70, ``quiverd_fatal_durability``, no traceback); the
image is remounted and a daemon started on it: every acknowledged bundle must be
stored exactly once. The same run with ``flush_policy = "never"`` must lose some
acknowledged bundles, or this harness could not tell a bug from a pass.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from quiverd.client import Client
from quiverd.runtime.serve import EXIT_FATAL
from tests.daemon.helpers import stored_bundles, tagged_table
from tests.daemon.mounts import MiB, mounted_image, remount

ROUNDS = int(os.environ.get("QUIVERD_POWER_CUT_ROUNDS", "5"))
IMAGE_BYTES = 320 * MiB  # mkfs.xfs refuses less than 300 MiB; the file is sparse
SETTINGS = {"segment.target_size_bytes": 1 * MiB, "segment.max_open_duration_ms": 500}


class Producer(threading.Thread):
    """Pipelines tagged bundles; records each ack as it arrives, until the daemon is gone."""

    def __init__(self, socket: Path, client: str, first_tag: int) -> None:
        super().__init__(daemon=True)
        self.socket, self.client, self.tag = socket, client, first_tag
        self.acked: dict[tuple[int, int], int] = {}

    def run(self) -> None:
        try:
            with Client.connect(self.socket) as c:
                while True:
                    tags = list(range(self.tag, self.tag + 16))
                    self.tag += 16
                    items = [tagged_table(t, rows=200 + t % 100) for t in tags]
                    for t, ack in zip(tags, c.iter_send(items, client=self.client),
                                      strict=False):
                        self.acked[(ack.shard, ack.sequence)] = t
        except Exception:
            pass  # the filesystem went down and the daemon with it


def one_round(daemon_factory: Any, short_dir: Path, policy: str, n: int,
              rng: random.Random) -> tuple[int, int]:
    """Returns (acknowledged, acknowledged but not stored after the restart)."""
    d = daemon_factory({**SETTINGS, "wal.flush_policy": policy}, name=f"{policy}{n}")
    image = short_dir / f"{policy}{n}.img"
    try:
        with mounted_image(d.data_dir, image, "xfs", IMAGE_BYTES):
            d.start()
            producers = [Producer(d.socket, f"p{i}", (n * 10 + i) * 1_000_000)
                         for i in range(2)]
            for p in producers:
                p.start()
            time.sleep(rng.uniform(0.4, 1.2))
            cut = subprocess.run(["xfs_io", "-x", "-c", "shutdown", str(d.data_dir)],
                                 capture_output=True, text=True, timeout=30)
            assert cut.returncode == 0, cut.stderr
            try:
                code = d.wait(20)
            except subprocess.TimeoutExpired:
                d.kill()
                pytest.fail(f"the daemon kept running on a dead filesystem:\n{d.log()[-3000:]}")
            for p in producers:
                p.join(10)
            assert code == EXIT_FATAL, d.log()[-3000:]
            assert d.events("quiverd_fatal_durability"), d.log()[-3000:]
            assert "Traceback" not in d.log(), d.log()[-3000:]
            remount(d.data_dir, image, "xfs")
            # What the power cut left, before recovery touches it (kept if a round loses).
            before = short_dir / f"{policy}{n}-before-recovery"
            shutil.copytree(d.data_dir, before)
            d.start()
            assert d.stop() == 0, d.log()[-3000:]
            acked = {k: t for p in producers for k, t in p.acked.items()}
            lost = missing(d.data_dir, acked)
            if lost and policy != "never":
                keep_evidence(d, policy, n, acked, lost, before)
            shutil.rmtree(before, ignore_errors=True)
            return len(acked), len(lost)
    finally:
        image.unlink(missing_ok=True)


def keep_evidence(d: Any, policy: str, n: int, acked: dict[tuple[int, int], int],
                  lost: list[tuple[int, int]], before: Path) -> None:
    """A round lost acknowledged bundles: print and keep everything needed to find why."""
    keep = Path(os.environ.get("QUIVERD_POWER_CUT_KEEP", "/tmp/power-cut-lost")) / f"{policy}{n}"
    keep.mkdir(parents=True, exist_ok=True)
    print(f"LOST in round {n}: {sorted(lost)[:40]} (evidence in {keep})")
    for event in ("wal_replayed", "wal_torn_tail", "wal_damage_skipped", "bundles_lost",
                  "segment_quarantined", "shard_recovered", "quiverd_fatal_durability"):
        for e in d.events(event):
            print(f"  {event}: {e}")
    (keep / "acked.json").write_text(json.dumps(sorted([*k, t] for k, t in acked.items())))
    (keep / "lost.json").write_text(json.dumps(sorted(lost)))
    shutil.copy(d.log_path, keep / "daemon.log")
    shutil.copytree(before, keep / "data-before-recovery", dirs_exist_ok=True)
    shutil.copytree(d.data_dir, keep / "data-after", dirs_exist_ok=True)


def missing(data_dir: Path, acked: dict[tuple[int, int], int]) -> list[tuple[int, int]]:
    """Acked bundles not stored; the stored ones must hold what was sent."""
    stored = stored_bundles(data_dir)  # asserts no bundle is stored twice
    for key, tag in acked.items():
        if key in stored:
            assert stored[key].slots[0].equals(tagged_table(tag, rows=200 + tag % 100)), key
    return [k for k in acked if k not in stored]  # `stored` (memory-mapped files) goes here


@pytest.fixture
def xfs_tools() -> None:
    if shutil.which("xfs_io") is None or shutil.which("mkfs.xfs", path="/usr/sbin:/sbin:"
                                                      + os.environ.get("PATH", "")) is None:
        print("SKIP: xfsprogs is not installed (apt-get install xfsprogs)")
        pytest.skip("xfsprogs is not installed")


@pytest.mark.slow
@pytest.mark.usefixtures("xfs_tools")
def test_power_cut_loses_no_acknowledged_bundle(daemon_factory, short_dir):
    rng = random.Random(int(os.environ.get("QUIVERD_CRASH_SEED", "7")))
    results = [one_round(daemon_factory, short_dir, "interval", n, rng) for n in range(ROUNDS)]
    print(f"power cut, flush_policy=interval: (acked, lost) per round {results}")
    assert all(acked > 50 for acked, _ in results), results
    assert all(lost == 0 for _, lost in results), f"acknowledged bundles lost: {results}"


@pytest.mark.slow
@pytest.mark.usefixtures("xfs_tools")
def test_power_cut_negative_control_never_policy_loses_acknowledged_bundles(
        daemon_factory, short_dir):
    """Without fdatasync the same cut must lose acked bundles: the harness can see loss."""
    rng = random.Random(int(os.environ.get("QUIVERD_CRASH_SEED", "7")))
    results = [one_round(daemon_factory, short_dir, "never", n, rng) for n in range(ROUNDS)]
    print(f"power cut, flush_policy=never: (acked, lost) per round {results}")
    assert all(acked > 50 for acked, _ in results), results
    assert any(lost > 0 for _, lost in results), f"no loss detected: {results}"
