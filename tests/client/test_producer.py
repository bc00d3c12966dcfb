"""Producer clients against a small in-test server on a real Unix socket."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quiverd.client.producer import AsyncClient, Client, FileProgress, iter_file_batches, send_files
from quiverd.kernel.bundle import TxnTag
from quiverd.kernel.errors import AtCapacity, ProtocolError, ShuttingDown, Unauthorized
from quiverd.protocol import codec as p
from tests.client.fake_server import FakeServer


def batch(i: int, rows: int = 3) -> pa.RecordBatch:
    return pa.record_batch([pa.array([i] * rows, pa.int64())], ["x"])


def error_by_client(frame: p.BundleFrame) -> bytes | None:
    codes = {"full": 5, "stopping": 6, "denied": 4, "oops": 7}
    if frame.client in codes:
        return p.encode_error(frame.request_id, codes[frame.client], f"{frame.client} says no")
    return None


# --- blocking Client --------------------------------------------------------------------


def test_client_send_returns_ack_and_server_sees_table(
    make_server: Callable[..., FakeServer],
) -> None:
    server = make_server()
    table = pa.table({"x": [1, 2, 3], "s": ["a", "b", None]})
    with Client.connect(server.path) as c:
        assert c.server.max_inflight == 4
        ack = c.send(table, client="web")
    assert ack == p.Ack(request_id=1, shard=1, sequence=1)
    (frame,) = server.received
    assert frame.client == "web" and frame.txn is None
    assert p.validate_bundle(frame)[0].row_count == 3
    assert pa.ipc.open_stream(frame.slots[0].ipc).read_all().equals(table)


def test_client_send_many_pipelines_to_max_inflight(make_server: Callable[..., FakeServer]) -> None:
    server = make_server(max_inflight=4, batch=4)
    with Client.connect(server.path) as c:
        acks = c.send_many([batch(i) for i in range(12)], client="web")
    assert [a.request_id for a in acks] == list(range(1, 13))  # input order despite reversal
    assert server.max_pending == 4
    assert [f.slots[0].row_count for f in server.received] == [3] * 12


def test_client_send_slots_and_txn(make_server: Callable[..., FakeServer]) -> None:
    server = make_server()
    txn = TxnTag(job_id="j1", partition=2, attempt=0, row_offset=30)
    with Client.connect(server.path) as c:
        c.send({0: batch(1), 62: pa.table({"y": ["z"]})}, client="web", txn=txn)
        with pytest.raises(ValueError, match="slot 63 outside 0..62"):
            c.send({63: batch(1)}, client="web")
    (frame,) = server.received
    assert [s.slot for s in frame.slots] == [0, 62] and frame.txn == txn


@pytest.mark.parametrize(
    ("client", "exc_type"),
    [("full", AtCapacity), ("stopping", ShuttingDown), ("oops", ProtocolError)],
)
def test_client_error_frames_map_to_exceptions_and_keep_connection(
    make_server: Callable[..., FakeServer], client: str, exc_type: type[Exception]
) -> None:
    server = make_server(respond=error_by_client)
    with Client.connect(server.path) as c:
        with pytest.raises(exc_type, match=f"{client} says no") as info:
            c.send(batch(1), client=client)
        assert c.send(batch(2), client="web").request_id == 2  # per-request error only
    if exc_type is ProtocolError:
        assert isinstance(info.value, ProtocolError) and info.value.code == p.ErrorCode.INTERNAL


def test_client_unauthorized_breaks_connection(make_server: Callable[..., FakeServer]) -> None:
    server = make_server(respond=error_by_client)
    with Client.connect(server.path) as c:
        with pytest.raises(Unauthorized):
            c.send(batch(1), client="denied")
        with pytest.raises(ConnectionError):
            c.send(batch(1), client="web")


def test_client_send_many_drains_in_flight_then_raises_first_error(
    make_server: Callable[..., FakeServer],
) -> None:
    server = make_server(max_inflight=2, batch=2, respond=error_by_client)
    items = [batch(0), batch(1), (batch(2), None), batch(3)]
    with Client.connect(server.path) as c:
        with pytest.raises(AtCapacity):
            c.send_many([items[0], items[1]], client="full")
        assert len(c.send_many(items, client="web")) == 4  # connection still clean


def test_client_handshake_error_raises(make_server: Callable[..., FakeServer]) -> None:
    server = make_server(hello_error=(p.ErrorCode.UNSUPPORTED_VERSION, "speak v9"))
    with pytest.raises(ProtocolError, match="speak v9") as info:
        Client.connect(server.path)
    assert info.value.code == p.ErrorCode.UNSUPPORTED_VERSION


def test_client_refuses_bundle_over_server_limit(make_server: Callable[..., FakeServer]) -> None:
    server = make_server()
    big = pa.table({"x": pa.array(range(200_000), pa.int64())})
    with Client.connect(server.path) as c:
        with pytest.raises(ProtocolError, match="exceeds the server's max_bundle_bytes") as info:
            c.send(big, client="web")
        assert info.value.code == p.ErrorCode.TOO_LARGE
        assert c.send(batch(1), client="web").request_id == 2
    assert len(server.received) == 1


def test_client_connection_closed_mid_request_raises(
    make_server: Callable[..., FakeServer],
) -> None:
    server = make_server(respond=lambda f: p.encode_error(f.request_id, 1, "malformed"))
    with Client.connect(server.path) as c:
        with pytest.raises(ProtocolError, match="malformed"):
            c.send_many([batch(1)], client="web")
        with pytest.raises(ConnectionError):
            c.send(batch(1), client="web")


# --- files ------------------------------------------------------------------------------


def write_files(tmp_path: Path) -> tuple[list[Path], pa.Table]:
    table = pa.Table.from_batches([batch(i, rows=i + 1) for i in range(3)])
    arrow_file, stream_file, parquet_file = (tmp_path / n for n in ("a.arrow", "b.s", "c.pq"))
    with pa.OSFile(str(arrow_file), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pa.OSFile(str(stream_file), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    pq.write_table(table, parquet_file, row_group_size=2)
    return [arrow_file, stream_file, parquet_file], table


def test_iter_file_batches_reads_ipc_file_stream_and_parquet(tmp_path: Path) -> None:
    paths, table = write_files(tmp_path)
    for path in paths:
        got = pa.Table.from_batches(list(iter_file_batches(path)))
        assert got.equals(table)
    bad = tmp_path / "bad"
    bad.write_bytes(b"definitely not arrow")
    with pytest.raises(ValueError, match="not a readable Arrow IPC or Parquet file"):
        list(iter_file_batches(bad))


def test_send_files_one_bundle_per_batch_with_progress(
    make_server: Callable[..., FakeServer], tmp_path: Path
) -> None:
    server = make_server(max_inflight=2)
    paths, table = write_files(tmp_path)
    seen: list[FileProgress] = []
    acks = list(send_files(server.path, paths, client="cli", progress=seen.append))
    assert len(acks) == len(server.received) == len(seen)
    assert sum(s.rows for s in seen) == 3 * table.num_rows
    assert [s.ack for s in seen] == acks
    assert seen[0].path == str(paths[0]) and seen[0].batch_index == 0


# --- AsyncClient ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_client_send_and_send_many(make_server: Callable[..., FakeServer]) -> None:
    server = make_server(max_inflight=3, batch=3)
    async with await AsyncClient.connect(server.path) as c:
        acks = await c.send_many([batch(i) for i in range(9)], client="web")
        assert [a.request_id for a in acks] == list(range(1, 10))
        more = await c.send_many([(batch(0), None)] * 3, client="web")
        assert [a.request_id for a in more] == [10, 11, 12]
    assert server.max_pending == 3 and len(server.received) == 12


@pytest.mark.asyncio
async def test_async_client_concurrent_senders_match_acks(
    make_server: Callable[..., FakeServer],
) -> None:
    server = make_server(max_inflight=4, batch=4)
    results: dict[int, p.Ack] = {}
    async with await AsyncClient.connect(server.path) as c:

        async def one(i: int) -> None:
            results[i] = await c.send(batch(i, rows=i + 1), client="web")

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
    assert len({a.request_id for a in results.values()}) == 8
    rows = {f.request_id: f.slots[0].row_count for f in server.received}
    assert all(rows[results[i].request_id] == i + 1 for i in range(8))
    assert server.max_pending == 4


@pytest.mark.asyncio
async def test_async_client_error_mapping(make_server: Callable[..., FakeServer]) -> None:
    server = make_server(respond=error_by_client)
    async with await AsyncClient.connect(server.path) as c:
        with pytest.raises(AtCapacity):
            await c.send(batch(1), client="full")
        with pytest.raises(ShuttingDown):
            await c.send_many([batch(1)], client="stopping")
        assert (await c.send(batch(1), client="web")).request_id == 3
        with pytest.raises(Unauthorized):
            await c.send(batch(1), client="denied")
        with pytest.raises(ConnectionError):
            await c.send(batch(1), client="web")


@pytest.mark.asyncio
async def test_async_client_handshake_error(make_server: Callable[..., FakeServer]) -> None:
    server = make_server(hello_error=(p.ErrorCode.UNAUTHORIZED, "uid 1000 not allowed"))
    with pytest.raises(Unauthorized, match="uid 1000"):
        await AsyncClient.connect(server.path)
