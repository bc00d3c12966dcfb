"""End to end: producers → daemon → WAL → segments, over a real socket and real files."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys

import pyarrow as pa
import pytest

from quiverd.client import Client
from quiverd.protocol import codec as protocol
from quiverd.protocol.frames import ErrorCode
from tests.daemon.helpers import stored_bundles, tagged_table


def test_daemon_acks_bundles_and_stores_them_byte_identical(daemon_factory):
    d = daemon_factory({"segment.max_open_duration_ms": 100}).start()
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
    d = daemon_factory({"shards": 2}).start()
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
    assert b"READY=1" in notify.recv(4096)
    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(i) for i in range(10)], client="x")
    assert d.stop() == 0
    assert b"STOPPING=1" in notify.recv(4096)
    assert len(stored_bundles(d.data_dir)) == 10
    notify.close()


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


@pytest.mark.parametrize("case", ["garbage", "oversize", "bad_version", "cut_ipc", "slot63"])
def test_bad_input_gets_an_error_frame_and_others_are_unaffected(daemon_factory, case):
    d = daemon_factory({"ingest.max_bundle_bytes": 1 << 20,
                        "wal.max_entry_bytes": 2 << 20}).start()
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
            parts = protocol.encode_bundle(1, "bad", {slot: ipc}, {slot: table.num_rows})
            bad.sendall(b"".join(bytes(p) for p in parts))
        code, message = _read_error(bad)
        assert code == expected, message
        assert message
        bad.close()
        ack = good.send(tagged_table(2), client="good")  # the other connection carries on
        assert ack.sequence >= 2
    assert d.status()["stopping"] is False


def _ipc(table: pa.Table) -> bytes:
    from quiverd.kernel.bundle import encode_ipc_stream

    return encode_ipc_stream(table)


def test_unauthorized_uid_gets_error_and_is_closed(daemon_factory, short_dir):
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    os.chmod(short_dir, 0o755)
    d = daemon_factory({"ingest.socket_mode": 0o666}).start()
    os.chmod(d.root, 0o755)
    # Fork and drop to uid/gid 65534 in the child: a real peer with other credentials.
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(rfd)
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            Client.connect(d.socket).send(pa.table({"a": [1]}), client="x")
            result = "sent"
        except Exception as exc:
            result = f"{type(exc).__name__} {exc}"
        os.write(wfd, result.encode())
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd) as r:
        result = r.read()
    os.waitpid(pid, 0)
    assert result.startswith("Unauthorized"), result
    assert "uid 65534" in result
    assert d.status()["ingest"]["unauthorized"] == 1


def test_client_refuses_reserved_slot_before_sending(daemon_factory):
    d = daemon_factory().start()
    with Client.connect(d.socket) as c, pytest.raises(ValueError, match="slot 63"):
        c.send({63: tagged_table(0)}, client="x")


def test_fuzzed_frames_never_hurt_the_daemon_or_other_connections(daemon_factory):
    """Property: any byte string after a valid HELLO gets an ERROR frame or a close."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    d = daemon_factory({"ingest.max_bundle_bytes": 1 << 20,
                        "wal.max_entry_bytes": 2 << 20}).start()
    good = Client.connect(d.socket)
    valid = b"".join(bytes(p) for p in protocol.encode_bundle(
        1, "fuzz", {0: _ipc(tagged_table(1))}, {0: 100}))

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.one_of(
        st.binary(min_size=1, max_size=300),
        st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)).map(
            lambda m: valid[:m[0]] + bytes([m[1] ^ valid[m[0]] or 1]) + valid[m[0] + 1:]),
        st.integers(1, len(valid) - 1).map(lambda n: valid[:n]),
    ))
    def fuzz(payload: bytes) -> None:
        s = _raw_connect(d.socket)
        try:
            _hello(s)
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(10)
            while s.recv(65536):  # the daemon answers (ACK, HELLO_OK or ERROR) and closes
                pass
        finally:
            s.close()
        good.send(tagged_table(2), client="good")  # others carry on

    fuzz()
    good.close()
    assert d.status()["ingest"]["errors"] >= 1
    assert d.stop() == 0
