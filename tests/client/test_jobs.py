"""Transactional writes from the producer clients (SPEC §7) against a fake server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pyarrow as pa
import pytest

from quiverd.client import AsyncClient, Client, EndAck, IpcPayload
from quiverd.client.jobs import end_ack, job_result
from quiverd.kernel.bundle import TxnTag, encode_ipc_stream
from quiverd.kernel.errors import JobConflict, ProtocolError
from quiverd.kernel.jobs import JobDecision, Winner
from quiverd.protocol import codec as p
from tests.client.fake_server import FakeServer

MakeServer = Callable[..., FakeServer]


def rows(n: int, start: int = 0) -> pa.RecordBatch:
    return pa.record_batch([pa.array(range(start, start + n), pa.int64())], ["x"])


def tagged(job: str, partition: int, attempt: int, sizes: list[int]
           ) -> list[tuple[pa.RecordBatch, TxnTag]]:
    out, offset = [], 0
    for n in sizes:
        out.append((rows(n, offset), TxnTag(job_id=job, partition=partition, attempt=attempt,
                                            row_offset=offset)))
        offset += n
    return out


def test_client_end_partition_after_tagged_bundles(make_server: MakeServer) -> None:
    server = make_server(max_inflight=4, batch=3)
    with Client.connect(server.path) as c:
        acks = c.send_many(tagged("j1", 2, 7, [3, 4, 5]), client="spark")
        end = c.end_partition("j1", 2, 7, client="spark", rows=12, checksum=99)
    assert end == EndAck(node_id="fake-node", shard=0, sequence=1)
    assert [a.request_id for a in acks] == [1, 2, 3]
    assert server.received_jobs[0] == p.JobRequest(request_id=4, body={
        "op": "end_partition", "client": "spark", "job_id": "j1", "partition": 2,
        "attempt": 7, "rows": 12, "checksum": 99})


def test_client_end_partition_refused_raises_job_conflict_and_keeps_connection(
        make_server: MakeServer) -> None:
    server = make_server()
    with Client.connect(server.path) as c:
        c.send_many(tagged("j1", 0, 1, [5]), client="spark")
        with pytest.raises(JobConflict, match="took 5 rows, the end marker says 6"):
            c.end_partition("j1", 0, 1, client="spark", rows=6, checksum=0)
        assert c.end_partition("j1", 0, 1, client="spark", rows=5, checksum=0).sequence == 1


def test_client_commit_is_idempotent_and_abort_after_commit_conflicts(
        make_server: MakeServer) -> None:
    server = make_server()
    winners = [Winner(partition=1, attempt=9, rows=5, checksum=3),
               Winner(partition=0, attempt=4, rows=2, checksum=1)]
    with Client.connect(server.path) as c:
        assert c.job_status("j1") == {"job_id": "j1", "state": "unknown"}
        first = c.commit_job("j1", winners)
        again = c.commit_job("j1", winners)
        with pytest.raises(JobConflict, match="'j1' is committed"):
            c.abort_job("j1", "changed my mind")
        with pytest.raises(JobConflict):
            c.commit_job("j1", winners[:1])
        assert c.job_status("j1")["state"] == "committed"
    assert first.decision == JobDecision(job_id="j1", state="committed",
                                         winners=(winners[1], winners[0]), decided_at_ns=1,
                                         decided_by="fake-node")
    assert (first.already, again.already, again.decision) == (False, True, first.decision)
    assert server.received_jobs[1].body == {"op": "commit", "job_id": "j1", "winners": [
        {"partition": 1, "attempt": 9, "rows": 5, "checksum": 3},
        {"partition": 0, "attempt": 4, "rows": 2, "checksum": 1}]}


def test_client_abort_twice_is_already_and_commit_after_abort_conflicts(
        make_server: MakeServer) -> None:
    server = make_server()
    with Client.connect(server.path) as c:
        first = c.abort_job("j2", "task failed")
        assert c.abort_job("j2").already
        with pytest.raises(JobConflict):
            c.commit_job("j2", [])
    assert first.decision.state == "aborted" and first.decision.reason == "task failed"
    assert not first.already


def test_client_job_between_pipelined_bundles_shares_ids_and_window(
        make_server: MakeServer) -> None:
    # Bundles 2..4 are answered only once the JOB comes (after it, reversed): their acks
    # reach iter_send after the JOB's reply reached job_status.
    server = make_server(max_inflight=4, hold=lambda f: 2 <= f.request_id <= 4)
    with Client.connect(server.path) as c:
        sends = c.iter_send(tagged("j3", 0, 1, [1, 1, 1, 1, 1]), client="spark")
        first = next(sends)
        assert c.job_status("j3") == {"job_id": "j3", "state": "unknown"}
        rest = list(sends)
        end = c.end_partition("j3", 0, 1, client="spark", rows=5, checksum=0)
    assert [a.request_id for a in [first, *rest]] == [1, 2, 3, 4, 6]
    assert [j.request_id for j in server.received_jobs] == [5, 7]
    assert end.sequence == 1


def test_client_rejects_bad_job_arguments_before_sending(make_server: MakeServer) -> None:
    server = make_server()
    with Client.connect(server.path) as c:
        with pytest.raises(ValueError, match="attempt 4294967296 outside 0..4294967295"):
            c.end_partition("j", 0, 2**32, client="spark", rows=1, checksum=0)
        with pytest.raises(ValueError, match="client name"):
            c.end_partition("j", 0, 0, client="has space", rows=1, checksum=0)
        with pytest.raises(ValueError, match="job_id must be 1..256 bytes"):
            c.job_status("")
        with pytest.raises(ValueError, match="partition 0 has two winners"):
            c.commit_job("j", [Winner(partition=0, attempt=1, rows=0, checksum=0)] * 2)
        assert c.job_status("j")["state"] == "unknown"  # nothing broke the connection
    assert len(server.received_jobs) == 1


def test_client_ipc_payload_is_sent_byte_for_byte(make_server: MakeServer) -> None:
    server = make_server()
    payload = encode_ipc_stream(rows(4))
    with Client.connect(server.path) as c:
        c.send(IpcPayload(ipc=payload, rows=4), client="spark")
        c.send({3: IpcPayload(ipc=memoryview(payload), rows=4)}, client="spark")
    assert [bytes(f.slots[0].ipc) for f in server.received] == [payload, payload]
    assert [f.slots[0].slot for f in server.received] == [0, 3]


def test_client_reply_of_the_wrong_kind_breaks_the_connection(make_server: MakeServer) -> None:
    server = make_server(respond=lambda f: p.encode_job_reply(f.request_id, {}))
    with Client.connect(server.path) as c:
        with pytest.raises(ProtocolError, match="answered request 1 with JobReply, not Ack"):
            c.send(rows(1), client="spark")
        with pytest.raises(ProtocolError):
            c.job_status("j")


@pytest.mark.parametrize(("reply", "message"), [
    ({"node_id": "n", "shard": "zero", "sequence": 1}, "end_partition: Expected `int`"),
    ({"node_id": "n"}, "end_partition: Object missing required field `shard`"),
])
def test_end_ack_checks_the_reply(reply: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        end_ack(reply)


def test_job_result_checks_the_reply_and_ignores_new_fields() -> None:
    ok = {"job_id": "j", "state": "aborted", "already": True, "new_field": [1]}
    assert job_result(ok, "abort").decision == JobDecision(job_id="j", state="aborted")
    with pytest.raises(ProtocolError, match="'already' must be a bool"):
        job_result({"job_id": "j", "state": "aborted"}, "abort")
    with pytest.raises(ProtocolError, match="commit: Invalid enum value .published."):
        job_result({"job_id": "j", "state": "published", "already": False}, "commit")


@pytest.mark.asyncio
async def test_async_client_jobs_interleaved_with_concurrent_sends(
        make_server: MakeServer) -> None:
    server = make_server(max_inflight=3)
    winners = [Winner(partition=0, attempt=5, rows=6, checksum=0)]
    async with await AsyncClient.connect(server.path) as c:
        status: dict[str, Any] = {}

        async def ask() -> None:
            status.update(await c.job_status("j4"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            acks = await c.send_many(tagged("j4", 0, 5, [1, 2, 3]), client="spark")
        end = await c.end_partition("j4", 0, 5, client="spark", rows=6, checksum=0)
        result = await c.commit_job("j4", winners)
        with pytest.raises(JobConflict):
            await c.abort_job("j4")
        assert (await c.abort_job("j5", "x")).decision.state == "aborted"
    assert status == {"job_id": "j4", "state": "unknown"}
    assert len({a.request_id for a in acks} | {j.request_id for j in server.received_jobs}) == 8
    assert end.sequence == 1 and result.decision.winners == tuple(winners)
    assert server.max_pending <= 3
