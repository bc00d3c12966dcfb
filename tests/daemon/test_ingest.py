"""End to end: producers → daemon → WAL → segments, over a real socket and real files."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import pyarrow as pa
import pytest

from quiverd.client import Client
from quiverd.protocol import codec as protocol
from quiverd.protocol.frames import ErrorCode
from tests.daemon.helpers import stored_bundles, tagged_table


def test_daemon_acks_bundles_and_stores_them_byte_identical(daemon_factory):
    d = daemon_factory({"segment.max_open_duration_ms": 100}, in_process=True).start()
    sent = {}
    with Client.connect(d.socket) as c:
        for client in ("web", "app", "db"):
            tables = [tagged_table(i, rows=10 + i) for i in range(20)]
            for t, ack in zip(tables, c.send_many(tables, client=client), strict=True):
                sent[(ack.shard, ack.sequence)] = (client, t)
    status = d.status()
    assert sum(s["acks"] for s in status["shards"]) == 60
    assert d.stop() == 0
    stored = stored_bundles(d.data_dir)
    assert set(stored) == set(sent)
    for key, (client, table) in sent.items():
        assert stored[key].client == client
        assert stored[key].slots[0].equals(table)


def test_one_clients_order_is_kept_on_one_shard(daemon_factory):
    d = daemon_factory({"shards": 2}, in_process=True).start()
    with Client.connect(d.socket) as c:
        acks = c.send_many([tagged_table(i) for i in range(50)], client="ordered")
    assert len({a.shard for a in acks}) == 1
    seqs = [a.sequence for a in acks]
    assert seqs == sorted(seqs) and seqs == list(range(seqs[0], seqs[0] + 50))


def test_multi_slot_bundle_and_txn_tag_survive_restart(daemon_factory):
    from quiverd.kernel.bundle import TxnTag

    d = daemon_factory({"segment.max_open_duration_ms": 60_000}).start()
    tag = TxnTag(job_id="job-1", partition=3, attempt=1, row_offset=200)
    data = {0: tagged_table(1), 5: pa.table({"x": [1.5, None]}), 62: tagged_table(2, rows=1)}
    with Client.connect(d.socket) as c:
        ack = c.send(data, client="spark", txn=tag)
    d.kill()  # the bundle is only in the WAL (segment still open)
    d.start()
    assert d.stop() == 0
    b = stored_bundles(d.data_dir)[(ack.shard, ack.sequence)]
    assert b.client == "spark" and b.txn == tag
    assert sorted(b.slots) == [0, 5, 62]
    for slot, table in data.items():
        assert b.slots[slot].equals(table)


def test_second_instance_is_refused_with_a_clear_message(daemon_factory):
    d = daemon_factory().start()
    proc = subprocess.run([sys.executable, "-m", "quiverd", "serve", "--config",
                           str(d.config_path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "in use by another quiverd" in proc.stderr
    assert f"pid {d.proc.pid}" in proc.stderr
    assert d.status()["stopping"] is False


def test_sigterm_drains_and_exits_zero_with_sd_notify(daemon_factory, short_dir):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = short_dir / "notify"
    notify.bind(str(notify_path))
    notify.settimeout(20)
    d = daemon_factory(env={"NOTIFY_SOCKET": str(notify_path)}).start()
    assert _notified_until(notify, b"READY=1")  # progress (STATUS=...) may come first
    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(i) for i in range(10)], client="x")
    assert d.stop() == 0
    assert _notified_until(notify, b"STOPPING=1")
    assert len(stored_bundles(d.data_dir)) == 10
    notify.close()


def _notified_until(notify: socket.socket, wanted: bytes) -> bool:
    """Read sd_notify datagrams until one holds ``wanted`` (recv times out otherwise)."""
    for _ in range(100):
        if wanted in notify.recv(4096):
            return True
    return False


def _raw_connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


def _read_error(s) -> tuple[int, str]:
    """Read frames until an ERROR arrives; return (code, message)."""
    decoder = protocol.FrameDecoder(1 << 20, from_client=False)
    while True:
        data = s.recv(65536)
        assert data, "connection closed without an ERROR frame"
        for msg in decoder.feed(data):
            if isinstance(msg, protocol.Error):
                return msg.code, msg.message


def _hello(s) -> None:
    s.sendall(protocol.encode_hello(role=protocol.Role.PRODUCER))


@pytest.mark.parametrize("case", ["garbage", "oversize", "bad_version", "cut_ipc", "slot63",
                                  "ipc_token", "ipc_body", "ipc_zstd"])
def test_bad_input_gets_an_error_frame_and_others_are_unaffected(daemon_factory, case):
    d = daemon_factory({"ingest.max_bundle_bytes": 1 << 20,
                        "wal.max_entry_bytes": 2 << 20}, in_process=True).start()
    with Client.connect(d.socket) as good:
        good.send(tagged_table(0), client="good")
        bad = _raw_connect(d.socket)
        expected = ErrorCode.MALFORMED
        if case == "garbage":
            bad.sendall(struct.pack("<IB", 5, 0xEE) + b"\xff" * 64)  # unknown frame type
        elif case == "oversize":
            _hello(bad)
            bad.sendall(struct.pack("<IB", 100 << 20, 3))
            expected = ErrorCode.TOO_LARGE
        elif case == "bad_version":
            bad.sendall(protocol.encode_hello(role=protocol.Role.PRODUCER, min_version=7,
                                              max_version=9))
            expected = ErrorCode.UNSUPPORTED_VERSION
        else:
            _hello(bad)
            table = tagged_table(1)
            ipc = _ipc(table)
            slot = 63 if case == "slot63" else 0
            if case == "cut_ipc":
                # Two batches, cut at the message boundary after the first: Arrow reads
                # the rest back as a complete stream; only the declared row count tells.
                table = pa.concat_tables([tagged_table(1), tagged_table(2)])
                ipc = _ipc(tagged_table(1))[:-8]
            elif case.startswith("ipc_"):
                ipc = _BAD_IPC[case](ipc)  # right CRC, bytes pyarrow fails on
            parts = protocol.encode_bundle(1, "bad", {slot: ipc}, {slot: table.num_rows})
            bad.sendall(b"".join(bytes(p) for p in parts))
        code, message = _read_error(bad)
        assert code == expected, message
        assert message
        bad.close()
        ack = good.send(tagged_table(2), client="good")  # the other connection carries on
        assert ack.sequence >= 2
    assert d.status()["stopping"] is False


def _cut_body(ipc: bytes) -> bytes:
    schema_end = 8 + struct.unpack_from("<i", ipc, 4)[0]
    return ipc[: schema_end + 8 + struct.unpack_from("<i", ipc, schema_end + 4)[0] + 16]


def _zstd(_: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    table = tagged_table(1)
    with pa.ipc.new_stream(sink, table.schema,
                           options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write(table)
    return sink.getvalue().to_pybytes()


# pyarrow raises plain OSError for the first two (issue 8 item 9): "Invalid IPC stream:
# negative continuation token", "Expected to be able to read N bytes for message body".
_BAD_IPC = {"ipc_token": lambda ipc: struct.pack("<i", -2) + bytes(16),
            "ipc_body": _cut_body, "ipc_zstd": _zstd}


def _ipc(table: pa.Table) -> bytes:
    from quiverd.kernel.bundle import encode_ipc_stream

    return encode_ipc_stream(table)


def test_unauthorized_uid_gets_error_and_is_closed(daemon_factory, short_dir):
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    os.chmod(short_dir, 0o755)
    d = daemon_factory({"ingest.socket_mode": 0o666}).start()
    os.chmod(d.root, 0o755)
    result = _as_nobody(lambda: Client.connect(d.socket).send(pa.table({"a": [1]}), client="x"))
    assert result.startswith("Unauthorized"), result
    assert "uid 65534" in result
    assert d.status()["ingest"]["unauthorized"] == 1


def _as_nobody(action) -> str:
    """Run ``action`` in a forked child as uid/gid 65534 (a real peer with other
    credentials); "sent" if it returned, else the exception's type and text."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(rfd)
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            action()
            result = "sent"
        except Exception as exc:
            result = f"{type(exc).__name__} {exc}"
        os.write(wfd, result.encode())
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd) as r:
        result = r.read()
    os.waitpid(pid, 0)
    return result


def test_client_refuses_reserved_slot_before_sending(daemon_factory):
    d = daemon_factory(in_process=True).start()
    with Client.connect(d.socket) as c, pytest.raises(ValueError, match="slot 63"):
        c.send({63: tagged_table(0)}, client="x")


@pytest.mark.parametrize(("name", "column"), [
    ("_quiver_ingested_at", pa.array(["a string"])),  # the uploader failed on it forever
    ("_quiver_ingested_at", pa.array([5], pa.timestamp("ns", tz="UTC"))),  # replaced ours
    ("_quiver_bundle", pa.array([7], pa.uint32())),  # replaced the bundle id
    ("_quiver_shard", pa.array(["x"])),
    ("_quiver_anything", pa.array([1])),
])
def test_reserved_column_prefix_is_refused_at_ingest_with_the_column_named(
        daemon_factory, name, column):
    from quiverd.client import IpcPayload
    from quiverd.kernel.errors import ProtocolError

    d = daemon_factory(in_process=True).start()
    data = pa.table({"a": [1], name: column})
    with Client.connect(d.socket) as c:
        ok = c.send(pa.table({"a": [1], "quiver_x": [2], "x_quiver_": [3]}), client="w")
        # An already encoded payload is not looked into by the client: the daemon refuses.
        with pytest.raises(ProtocolError, match=f"slot 0: column '{name}': the prefix "
                           "'_quiver_' is reserved") as info:
            c.send(IpcPayload(ipc=_ipc(data), rows=1), client="w")
        assert info.value.code == ErrorCode.MALFORMED
    with Client.connect(d.socket) as c:  # a table: refused before anything is sent
        with pytest.raises(ProtocolError, match=f"column '{name}'"):
            c.send({2: data}, client="w")
        c.send(tagged_table(1), client="w")  # the connection is still usable
    [refused] = d.events("ingest_protocol_error")  # one refusal: the client's never left
    assert name in refused["error"]
    assert d.stop() == 0
    stored = stored_bundles(d.data_dir)
    assert len(stored) == 2 and (ok.shard, ok.sequence) in stored


def test_silent_connections_cannot_lock_producers_out(daemon_factory):
    d = daemon_factory({"ingest.max_connections": 8, "ingest.max_connections_per_uid": 8,
                        "ingest.handshake_timeout_ms": 1000}, in_process=True).start()
    silent = [_raw_connect(d.socket) for _ in range(8)]  # never send HELLO
    late = _raw_connect(d.socket)
    _hello(late)
    code, message = _read_error(late)  # answered at once, not left in the backlog
    assert code == ErrorCode.AT_CAPACITY and "ingest.max_connections" in message
    for s in silent:  # closed after the handshake timeout, with a reason
        code, message = _read_error(s)
        assert code == ErrorCode.TIMEOUT, message
        assert "no HELLO within 1000 ms" in message
        assert s.recv(1) == b""
        s.close()
    late.close()
    with Client.connect(d.socket) as c:  # the slots are free again
        c.send(tagged_table(1), client="after")
    ingest = d.status()["ingest"]
    assert ingest["timeouts"] == 8 and ingest["refused"] == 1


def test_one_uid_at_its_connection_limit_does_not_lock_out_another(daemon_factory, short_dir):
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    os.chmod(short_dir, 0o755)
    d = daemon_factory({"ingest.socket_mode": 0o666, "ingest.allowed_uids": [65534],
                        "ingest.max_connections": 16,
                        "ingest.max_connections_per_uid": 4}).start()
    os.chmod(d.root, 0o755)
    mine = [Client.connect(d.socket) for _ in range(4)]
    extra = _raw_connect(d.socket)
    _hello(extra)
    code, message = _read_error(extra)
    assert code == ErrorCode.AT_CAPACITY
    assert "uid 0 already has 4 connections" in message and "per peer uid" in message
    result = _as_nobody(lambda: Client.connect(d.socket).send(pa.table({"a": [1]}), client="n"))
    assert result == "sent"
    for c in mine:
        c.close()
    extra.close()


def test_one_uid_stalling_frames_does_not_keep_another_uids_bundle_waiting(daemon_factory,
                                                                            short_dir):
    """Issue 17: nine stalled frames of one peer filled the whole pending-bytes budget and
    another producer's 10-row bundle waited until they timed out (502 s by default)."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    mib = 1 << 20
    os.chmod(short_dir, 0o755)
    d = daemon_factory({"ingest.socket_mode": 0o666, "ingest.allowed_uids": [65534],
                        "ingest.max_bundle_bytes": mib, "ingest.max_pending_bytes": 8 * mib,
                        "ingest.idle_timeout_ms": 60_000}).start()
    os.chmod(d.root, 0o755)
    stalled = []
    try:
        for _ in range(9):  # each announces a 1 MiB bundle, sends 1000 bytes of it, stalls
            s = _raw_connect(d.socket)
            _hello(s)
            s.sendall(struct.pack("<IB", mib, protocol.FrameType.BUNDLE) + bytes(1000))
            stalled.append(s)
        _status_until(d, lambda i: i["budget_waits"] >= 1)  # uid 0 can take no more
        started = time.monotonic()
        result = _as_nobody(lambda: Client.connect(d.socket, timeout=10).send(
            tagged_table(1, rows=10), client="other"))
        waited = time.monotonic() - started
        assert result == "sent", result  # the old code: TimeoutError after 10 s
        assert waited < 5, f"uid 65534's bundle waited {waited:.1f} s"
        # uid 0 holds its share (half: 4 frames); its other 5 frames wait for its bytes.
        ingest = d.status()["ingest"]
        assert 4 * (mib - 1) <= ingest["pending_bytes"] <= 4 * mib
        assert ingest["budget_waits"] == 5
        full = d.events("ingest_uid_share_full")  # says which peer, once a second at most
        assert full and {e["uid"] for e in full} == {0}
    finally:
        for s in stalled:
            s.close()


def test_one_uid_stalling_64_mib_frames_does_not_keep_its_own_fresh_connection_waiting(
        daemon_factory):
    """Issue 26: nine stalled 64 MiB frames of one uid kept that uid's other connection
    from any ACK for 90 s: 4 held its share (256 MiB, half the default budget), 5 waited
    untimed behind them, and each wave stalled for a whole idle timeout in turn."""
    mib = 1 << 20
    d = daemon_factory({"ingest.idle_timeout_ms": 4000},
                       in_process=True).start()  # default budget sizes
    stalled = []
    try:
        for _ in range(9):  # each announces a 64 MiB bundle, sends 64 KiB of it, stalls
            s = _raw_connect(d.socket)
            _hello(s)
            s.sendall(struct.pack("<IB", 64 * mib, protocol.FrameType.BUNDLE) + bytes(1 << 16))
            stalled.append(s)
        ingest = _status_until(d, lambda i: i["budget_waits"] >= 5)
        assert ingest["pending_bytes"] == 4 * (64 * mib - 1)  # the uid's share is held
        started = time.monotonic()
        with Client.connect(d.socket, timeout=5) as fresh:  # the old code: TimeoutError
            fresh.send(tagged_table(1, rows=10), client="fresh")
        waited = time.monotonic() - started
        assert waited < 5, f"the fresh connection's bundle waited {waited:.1f} s"
        # Each stalled frame is closed: at once when another frame waits for its bytes,
        # else after the idle timeout, counted from when it began to wait for budget.
        for s in stalled:
            code, message = _read_error(s)
            assert code == ErrorCode.TIMEOUT and "frame stalled" in message, message
        assert _status_until(d, lambda i: i["pending_bytes"] == 0)["connections"] == 0
    finally:
        for s in stalled:
            s.close()


def _status_until(d: Any, done: Any, timeout_s: float = 10) -> dict[str, Any]:
    """Poll the daemon's ingest status until ``done`` holds (it has no event to wait on)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ingest = d.status()["ingest"]
        if done(ingest):
            return ingest
        assert time.monotonic() < deadline, f"ingest status never got there: {ingest}"
        time.sleep(0.02)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_half_sent_bundles_hold_no_more_memory_than_the_pending_budget(daemon_factory):
    """Issue 8 item 8: 24 peers each announce a 16 MiB bundle, send most of it, stall."""
    mib = 1 << 20
    d = daemon_factory({"ingest.max_bundle_bytes": 16 * mib, "wal.max_entry_bytes": 17 * mib,
                        "ingest.max_pending_bytes": 32 * mib,
                        "ingest.max_pending_bytes_per_uid": 32 * mib,  # all peers are uid 0
                        # Longer than the 2 s of pushing: a wait for budget is a stall too.
                        "ingest.idle_timeout_ms": 3000}).start()
    with Client.connect(d.socket) as good:
        good.send(tagged_table(0), client="good")
    before = _rss_bytes(d.proc.pid)
    peers: list[list[Any]] = []
    try:
        _stall_half_sent_bundles(d, peers, before)
    finally:
        for s, _ in peers:
            s.close()
    with Client.connect(d.socket) as good:  # budget came back: producers go on
        good.send(tagged_table(1), client="good")


def _stall_half_sent_bundles(d: Any, peers: list[list[Any]], before: int) -> None:
    mib, chunk = 1 << 20, bytes(1 << 20)
    for _ in range(24):
        s = _raw_connect(d.socket)
        _hello(s)
        s.sendall(struct.pack("<IB", 16 * mib, protocol.FrameType.BUNDLE))
        s.setblocking(False)
        peers.append([s, 0])
    peak, deadline = before, time.monotonic() + 2.0
    while time.monotonic() < deadline:  # push 15 MiB each, as fast as the daemon reads
        busy = [peer for peer in peers if peer[1] < 15 * mib]
        _, writable, _ = select.select([], [peer[0] for peer in busy], [], 0.05)
        for peer in busy:
            if peer[0] in writable:
                with contextlib.suppress(BlockingIOError, BrokenPipeError,
                                         ConnectionResetError):
                    peer[1] += peer[0].send(chunk)
        peak = max(peak, _rss_bytes(d.proc.pid))
    # The two peers holding budget got (almost) all their bytes in; the rest wait.
    assert sum(sent for _, sent in peers) >= 30 * mib
    # Budget (32 MiB) + receive scratch (24 x 1 MiB) + allocator slack (freed frame
    # buffers the memory pool keeps): 88 MiB. The old code grew by 391 MiB here.
    assert peak - before < 88 * mib, f"RSS grew by {(peak - before) / mib:.0f} MiB"
    ingest = d.status()["ingest"]
    assert ingest["pending_bytes"] <= 32 * mib + protocol.MAX_FRAME_OVERHEAD
    assert ingest["budget_waits"] >= 20  # the others wait, reading nothing
    # The two holding budget stall mid-frame while others wait for their bytes: closed
    # after reader.CONTENDED_STALL_MS (the rest in turn, or after idle_timeout_ms).
    timed_out = 0
    for s, _ in peers:
        s.settimeout(0.1 if timed_out else 5)
        try:
            code, message = _read_error(s)
        except TimeoutError:
            continue
        assert code == ErrorCode.TIMEOUT and "frame stalled" in message
        timed_out += 1
    assert timed_out >= 1


def test_subscriber_gets_an_error_frame_for_bad_frames_and_a_late_subscribe(daemon_factory):
    from quiverd.net.admin import request

    d = daemon_factory({"ingest.handshake_timeout_ms": 500}, in_process=True).start()
    request(d.admin_socket, "subscribers.add", {"name": "sub"})
    s = _raw_connect(d.socket)
    s.sendall(protocol.encode_hello(protocol.Role.SUBSCRIBER) + protocol.encode_subscribe("sub", 4)
              + protocol.encode_ack_bundle(99, 1, 1))
    code, message = _read_error(s)  # after SUBSCRIBED
    assert code == ErrorCode.MALFORMED and "no shard 99" in message
    s.close()
    late = _raw_connect(d.socket)
    late.sendall(protocol.encode_hello(protocol.Role.SUBSCRIBER))  # and no SUBSCRIBE
    code, message = _read_error(late)
    assert code == ErrorCode.TIMEOUT and "no SUBSCRIBE within 500 ms" in message
    late.close()
