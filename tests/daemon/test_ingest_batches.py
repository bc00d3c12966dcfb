"""The batch paths of ingest, end to end: several BUNDLE frames in one client write.

A raw producer connection sends all its frames with one ``sendall``, so the daemon
reads them as one batch (one loop pass validates and routes them, one hand-over per
shard). Each test checks what the producer sees on the wire and what a restart
finds on disk:

- frames for both shards: acked with the right shard, contiguous per shard, stored;
- a bad frame in the middle: the ones before it are durable, it and the rest are not;
- a failed fdatasync with writes behind it: nothing after the last good sync is acked;
- SIGTERM while an fdatasync is held: nothing acked is lost, the daemon exits 0.

Syncs are held with the ``wal.fdatasync=gate:<file>`` fault rule (quiverd/kernel/faults.py).
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from quiverd.client import Client
from quiverd.kernel.bundle import encode_ipc_stream
from quiverd.net.connection import shard_of
from quiverd.protocol import codec as protocol
from quiverd.protocol.frames import Ack, Error, ErrorCode
from quiverd.runtime import serve as daemon
from tests.daemon.helpers import stored_bundles, tagged_table


class Wire:
    """A raw producer connection: frames out in one write, replies decoded as they come."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))
        self.decoder = protocol.FrameDecoder(protocol.REPLY_FRAME_MAX, from_client=False)
        self.got: deque[protocol.Message] = deque()
        self.sock.sendall(protocol.encode_hello(role=protocol.Role.PRODUCER))
        assert isinstance(self.next(), protocol.HelloOk)

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def next(self) -> protocol.Message | None:
        """The next reply; None once the daemon closed the connection."""
        while not self.got:
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                return None
            self.got.extend(self.decoder.feed(data))
        return self.got.popleft()

    def pending(self) -> list[protocol.Message]:
        """The replies already received, without waiting for more."""
        self.sock.setblocking(False)
        try:
            while data := self.sock.recv(1 << 16):
                self.got.extend(self.decoder.feed(data))
        except BlockingIOError:
            pass
        finally:
            self.sock.settimeout(10)
        out = list(self.got)
        self.got.clear()
        return out

    def rest(self) -> list[protocol.Message]:
        """Every reply until the daemon closes the connection."""
        return list(iter(self.next, None))

    def close(self) -> None:
        self.sock.close()


def frame(request_id: int, client: str, table: pa.Table) -> bytes:
    parts = protocol.encode_bundle(request_id, client, {0: encode_ipc_stream(table)},
                                   {0: table.num_rows})
    return b"".join(bytes(p) for p in parts)


def client_on(shard: int, shards: int = 2) -> str:
    """A client name the daemon routes to ``shard``."""
    return next(name for name in (f"p{i}" for i in itertools.count())
                if shard_of(name, shards) == shard)


def until(what: str, done: Callable[[], Any], timeout_s: float = 10) -> Any:
    """Poll the daemon (its status, its log) until ``done()`` is truthy."""
    deadline = time.monotonic() + timeout_s
    while not (value := done()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def shard_counts(d: Any, key: str) -> int:
    return sum(s[key] for s in d.status()["shards"])


def tag_of(stored: Any) -> int:
    return int(stored.slots[0].column("tag")[0].as_py())


def test_one_read_batch_for_both_shards_is_acked_per_shard_in_order_and_stored(daemon_factory):
    d = daemon_factory({"shards": 2}, in_process=True).start()
    clients = (client_on(0), client_on(1))
    sent = {rid: (clients[rid % 2], tagged_table(rid, rows=10 + rid)) for rid in range(1, 13)}
    wire = Wire(d.socket)
    wire.send(*(frame(rid, client, table) for rid, (client, table) in sent.items()))
    acks: dict[int, Ack] = {}
    for _ in sent:
        reply = wire.next()
        assert isinstance(reply, Ack), reply
        acks[reply.request_id] = reply
    wire.close()
    assert sorted(acks) == sorted(sent)
    for shard in (0, 1):
        # In request order, on the client's shard, numbered 1, 2, ... without a gap.
        mine = [rid for rid in sent if shard_of(sent[rid][0], 2) == shard]
        assert [(acks[rid].shard, acks[rid].sequence) for rid in mine] == [
            (shard, seq) for seq in range(1, len(mine) + 1)]
    assert d.stop() == 0
    stored = stored_bundles(d.data_dir)
    assert set(stored) == {(a.shard, a.sequence) for a in acks.values()}
    for rid, (client, table) in sent.items():
        bundle = stored[(acks[rid].shard, acks[rid].sequence)]
        assert bundle.client == client and bundle.slots[0].equals(table), rid


def test_bad_frame_mid_batch_is_refused_the_ones_before_durable_the_rest_dropped(
        daemon_factory):
    d = daemon_factory({"shards": 2}).start()
    a, b = client_on(0), client_on(1)
    bad = pa.table({"tag": pa.array([3], pa.int64()), "_quiver_x": [3]})  # valid IPC, CRC
    with Client.connect(d.socket) as other:
        other.send(tagged_table(100), client="other")
        wire = Wire(d.socket)
        wire.send(frame(1, a, tagged_table(1)), frame(2, b, tagged_table(2)),
                  frame(3, a, bad), frame(4, b, tagged_table(4)))
        replies = wire.rest()  # the daemon closes the connection after its ERROR
        wire.close()
        error = replies[-1]
        assert isinstance(error, Error), replies
        assert error.code == ErrorCode.MALFORMED and "'_quiver_x'" in error.message, error
        # 1 and 2 are answered before the closing ERROR; nothing follows it, and 3 and 4
        # were never acked.
        assert sorted((type(r).__name__, r.request_id) for r in replies[:-1]) == [
            ("Ack", 1), ("Ack", 2)], replies
        # 1 and 2 went to their shards and were acked there (with "other"'s bundle).
        until("1 and 2 acked by their shards", lambda: shard_counts(d, "acks") >= 3)
        other.send(tagged_table(101), client="other")  # the other connection carries on
    assert (shard_counts(d, "acks"), shard_counts(d, "appends")) == (4, 4)  # 4 never written
    d.kill()
    d.start()
    assert d.stop() == 0
    stored = stored_bundles(d.data_dir)
    assert sorted(tag_of(s) for s in stored.values()) == [1, 2, 100, 101]
    by_tag = {tag_of(s): s for s in stored.values()}
    assert (by_tag[1].client, by_tag[2].client) == (a, b)
    assert by_tag[1].slots[0].equals(tagged_table(1))
    assert by_tag[2].slots[0].equals(tagged_table(2))


def test_failed_fdatasync_with_writes_behind_it_acks_none_of_them_and_exits_70(
        daemon_factory, short_dir):
    gate = short_dir / "sync.gate"  # while it exists, every WAL fdatasync waits
    d = daemon_factory({"shards": 1}).start(
        faults=f"wal.fdatasync=gate:{gate};wal.fdatasync=eio@2")
    wire = Wire(d.socket)
    wire.send(frame(1, "p", tagged_table(1)))
    first = wire.next()
    assert isinstance(first, Ack) and first.request_id == 1, first
    gate.touch()
    wire.send(frame(2, "p", tagged_table(2)))
    # 2 written; with the writer idle its fdatasync starts at once and waits at the gate.
    until("2 written", lambda: shard_counts(d, "appends") == 2)
    wire.send(*(frame(rid, "p", tagged_table(rid)) for rid in range(3, 7)))
    until("3..6 written behind the held sync", lambda: shard_counts(d, "appends") == 6)
    assert (shard_counts(d, "acks"), shard_counts(d, "fsyncs")) == (1, 1)
    gate.unlink()  # the held fdatasync (the 2nd) goes on, and fails with EIO
    while (reply := wire.next()) is not None:  # until the daemon is gone
        assert not isinstance(reply, Ack), f"acked after a failed fdatasync: {reply}"
    wire.close()
    assert d.wait(30) == daemon.EXIT_FATAL, d.log()[-3000:]
    [fatal] = d.events("quiverd_fatal_durability")
    assert "fdatasync" in fatal["error"] and fatal["errno"] == "EIO", fatal
    assert fatal.get("path", "").startswith(str(d.data_dir / "shard-0")), fatal
    assert "Traceback" not in d.log()
    d.start()
    assert d.stop() == 0
    stored = stored_bundles(d.data_dir)
    assert stored[(first.shard, first.sequence)].slots[0].equals(tagged_table(1))


def test_sigterm_while_fdatasync_held_loses_no_acked_bundle_and_exits_zero(
        daemon_factory, short_dir):
    gate = short_dir / "sync.gate"
    d = daemon_factory({"shards": 1}).start(faults=f"wal.fdatasync=gate:{gate}")
    assert d.proc is not None
    tables = {rid: tagged_table(rid) for rid in range(1, 8)}
    wire = Wire(d.socket)
    wire.send(frame(1, "p", tables[1]))
    first = wire.next()
    assert isinstance(first, Ack), first
    gate.touch()
    wire.send(*(frame(rid, "p", tables[rid]) for rid in range(2, 7)))
    until("2..6 written, their sync held", lambda: shard_counts(d, "appends") == 6)
    d.proc.send_signal(signal.SIGTERM)
    until("the stop began", lambda: d.events("quiverd_stopping"))
    with contextlib.suppress(OSError):  # after the stop began: not read, or refused
        wire.send(frame(7, "p", tables[7]))
    assert d.proc.poll() is None  # the stop waits for the held fdatasync
    # Nothing is acked past the last sync that returned, stopping or not.
    assert (shard_counts(d, "acks"), wire.pending()) == (1, [])
    gate.unlink()
    assert d.wait(30) == 0, d.log()[-3000:]
    replies = [first, *wire.rest()]
    wire.close()
    acked = {r.request_id: r for r in replies if isinstance(r, Ack)}
    refused = [r for r in replies if isinstance(r, Error)]
    assert all(r.code == ErrorCode.SHUTTING_DOWN for r in refused), refused
    assert not set(acked) & {r.request_id for r in refused}, replies
    d.start()
    assert d.stop() == 0
    stored = stored_bundles(d.data_dir)
    lost = [rid for rid, ack in acked.items() if (ack.shard, ack.sequence) not in stored]
    assert not lost, f"acked and lost: {lost}"
    for rid, ack in acked.items():
        assert stored[(ack.shard, ack.sequence)].slots[0].equals(tables[rid]), rid
