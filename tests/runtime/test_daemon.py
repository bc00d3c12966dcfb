"""The daemon in process: ``Daemon.run`` with an injected stop trigger, no subprocess.

Real sockets, real files; the subprocess tests in tests/daemon cover signals,
exit codes and crashes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pyarrow as pa
import pytest

from quiverd.client import AsyncClient
from quiverd.kernel.config import Config, loads
from quiverd.kernel.layout import DataDir
from quiverd.runtime.daemon import Daemon
from quiverd.segments.reader import SegmentReader


def _config(tmp_path: Path, **extra: str) -> Config:
    lines = [f'data_dir = "{tmp_path / "data"}"', "shards = 2",
             "[ingest]", f'socket_path = "{tmp_path / "in.sock"}"',
             "[admin]", f'socket_path = "{tmp_path / "adm.sock"}"',
             "[segment]", "max_open_duration_ms = 60000"]
    lines += [f"{k} = {v}" for k, v in extra.items()]
    (tmp_path / "data").mkdir()
    return loads("\n".join(lines) + "\n")


def _table(i: int) -> pa.Table:
    return pa.table({"i": pa.array([i] * 10, pa.int64()), "s": [f"row-{i}"] * 10})


@asynccontextmanager
async def _running(cfg: Config) -> AsyncIterator[Daemon]:
    """A ready daemon in this process; stopped through its trigger on exit."""
    stop = anyio.Event()
    daemon = Daemon(cfg, stop=stop, handle_signals=False)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(daemon.run)  # returns once ready: sockets listening
            yield daemon
            stop.set()
        # run() returned: every pipeline drained.


@pytest.mark.asyncio
async def test_daemon_run_in_process_acks_then_stops_on_trigger(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    async with _running(cfg) as daemon:
        async with await AsyncClient.connect(cfg.ingest_socket) as client:
            acks = [await client.send(_table(i), client=f"c{i}") for i in range(6)]
        assert len({(a.shard, a.sequence) for a in acks}) == 6  # distinct ids
        assert {a.shard for a in acks} <= {0, 1}
    # The open segments were sealed and finalized at shutdown.
    assert daemon.stopping and not any(s.unfinished for s in daemon.shards)
    rows = []
    for i in range(cfg.shard_count):
        for path in sorted(DataDir(Path(cfg.data_dir)).shard(i).segments_dir.glob("*.qseg")):
            with SegmentReader.open(path) as reader:
                rows += [(b.client, b.slots[0].column("i")[0].as_py()) for b in reader.bundles()]
    assert sorted(rows) == [(f"c{i}", i) for i in range(6)]


@pytest.mark.asyncio
async def test_daemon_run_in_process_status_and_subscriber_ops(tmp_path: Path) -> None:
    async with _running(_config(tmp_path)) as daemon:
        result = await daemon.subscriber_op("add", "exporter")
        assert result == {"name": "exporter", "op": "add", "shards": 2}
        # The lake is on by default: its built-in subscriber is registered at start.
        assert [s["name"] for s in daemon.subscribers()] == ["exporter", "uploader"]
        with pytest.raises(ValueError, match="invalid subscriber name"):
            await daemon.subscriber_op("add", "Not Valid")
        assert [s["shard"] for s in daemon.status()["shards"]] == [0, 1]


def test_daemon_names_the_lake_subscriber_as_the_uploader_does() -> None:
    # The daemon does not import the lake when it is off, so it spells the name itself.
    from quiverd.runtime import daemon as daemon_mod
    from quiverd_actors.uploader import SUBSCRIBER

    assert daemon_mod.LAKE_SUBSCRIBER == SUBSCRIBER


def test_daemon_with_lake_off_does_not_load_the_lake() -> None:
    # OpenDAL, asyncpg and Parquet cost ~30 MB of RSS: `quiverd serve` with the lake off
    # (and every CLI command but the lake's) must not import them.
    import subprocess
    import sys

    code = ("import sys; from quiverd.cli import main; main._parser(); "
            "import quiverd.runtime.serve, quiverd.runtime.daemon; "
            "print(sorted(m for m in ('opendal', 'asyncpg', 'pyarrow.parquet', "
            "'quiverd.lake.tier') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout
