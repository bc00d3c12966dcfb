"""runtime.staging with writer leases: two daemons' staging on one (SQLite) catalog.

A job staged on daemon A whose writer is still connected to daemon B (a partition
still running on another host) is not expired by A; once B's last writer connection
closes, the job is expired writer_timeout_s later, by whichever daemon comes first.
"""

from __future__ import annotations

import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import anyio
import pytest

from quiverd.kernel.config import Config, StagingConfig, validate
from quiverd.kernel.errors import ConfigError
from quiverd.runtime.staging import Staging
from tests.runtime.test_staging import eventually, ref, running, segment


def node(tmp_path: Path, name: str, **staging: int) -> AbstractAsyncContextManager[Staging]:
    return running(tmp_path, node_id=name, **staging)


@pytest.mark.asyncio
async def test_a_writer_on_another_daemon_keeps_the_job_until_it_closes(
        tmp_path: Path) -> None:
    async with node(tmp_path, "a", writer_timeout_s=1) as a, \
            node(tmp_path, "b", writer_timeout_s=1) as b:
        a.add_segment(segment(1, [ref("j", 0, 1), ref("j", 0, 1, (1, 1))]))
        b.hold("j", holder=7)  # partition 1 still writing, on b
        await anyio.sleep(2.5)  # 2.5 x writer_timeout_s with no writer on a
        assert "j" not in a.decisions
        assert a.undecided()[0]["writers"] == 0 and a.undecided()[0]["expires_in_s"] == 0
        b.release(7)
        closed = time.monotonic()
        await eventually(lambda: "j" in a.decisions, timeout_s=5)
        took = time.monotonic() - closed
        assert a.decisions["j"].state == "expired"
        # b's lease was renewed at most writer_timeout_s / 4 before it closed
        assert 0.7 < took < 1 + 1.5, took


@pytest.mark.asyncio
async def test_a_held_job_never_expires_and_a_released_one_gets_its_grace(
        tmp_path: Path) -> None:
    async with node(tmp_path, "a", writer_timeout_s=1) as a:
        a.hold("live", holder=1)
        a.add_segment(segment(1, [ref("live", 0, 1), ref("gone", 0, 2)]))
        await anyio.sleep(1.5)
        assert "live" not in a.decisions
        await eventually(lambda: "gone" in a.decisions)
        assert a.keepalive("live", holder=2)["state"] == "staged"
        a.release(1)
        await anyio.sleep(0.5)
        assert "live" not in a.decisions  # connection 2 still holds it
        a.release(2)
        await eventually(lambda: "live" in a.decisions)
        assert a.decisions["live"].reason.startswith("no writer connection")


@pytest.mark.parametrize("seconds", [0, 901])
def test_writer_timeout_outside_1_to_900_s_is_a_config_error(tmp_path: Path,
                                                              seconds: int) -> None:
    cfg = Config(data_dir=str(tmp_path), staging=StagingConfig(writer_timeout_s=seconds))
    with pytest.raises(ConfigError, match="staging.writer_timeout_s"):
        validate(cfg)
