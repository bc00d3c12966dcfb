"""A threaded quiverd stand-in on a real Unix socket, for the client's tests.

FrameDecoder in, ACK/JOB_OK/ERROR frames out. Answers are held until ``batch``
requests are pending (or a JOB arrives), then sent in reverse order: a client that
does not pipeline would hang, and out-of-order answers must still reach the right
request. Bundles that ``hold`` picks are answered only when a JOB arrives.
``FakeJobs`` answers JOB requests the way SPEC §7 asks the daemon to.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quiverd.protocol import codec as p

# What the fake server does with a bundle: reply bytes, or None for a plain ack.
Responder = Callable[[p.BundleFrame], bytes | None]
Key = tuple[str, int, int]  # (job_id, partition, attempt)


class FakeJobs:
    """Job decisions for every connection of one server; rows per connection.

    ``end_partition`` is refused (JOB_CONFLICT) unless the connection sent exactly
    ``rows`` rows of the attempt at contiguous offsets from 0; the first commit or
    abort of a job stands, the same one again answers ``already``.
    """

    def __init__(self, node_id: str = "fake-node") -> None:
        self.node_id = node_id
        self.decisions: dict[str, dict[str, Any]] = {}
        self.ends: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def answer(self, req: p.JobRequest, rows: dict[Key, int]) -> bytes:
        with self.lock:
            self.requests.append(req.body)
            reply = self._reply(req.body, rows)
        if isinstance(reply, str):
            return p.encode_error(req.request_id, p.ErrorCode.JOB_CONFLICT, reply)
        return p.encode_job_reply(req.request_id, reply)

    def _reply(self, body: dict[str, Any], rows: dict[Key, int]) -> dict[str, Any] | str:
        job_id = body["job_id"]
        if body["op"] == "end_partition":
            key = (job_id, body["partition"], body["attempt"])
            if rows.get(key, 0) != body["rows"]:
                return (f"this connection took {rows.get(key, 0)} rows, the end marker says "
                        f"{body['rows']}")
            self.ends.append(body)
            return {"node_id": self.node_id, "shard": 0, "sequence": len(self.ends)}
        old = self.decisions.get(job_id)
        if body["op"] == "status":
            return {"job_id": job_id, "state": old["state"] if old else "unknown"}
        state = "committed" if body["op"] == "commit" else "aborted"
        winners = sorted(body.get("winners", []), key=lambda w: w["partition"])
        if old is None:
            self.decisions[job_id] = old = {
                "job_id": job_id, "state": state, "winners": winners, "decided_at_ns": 1,
                "decided_by": self.node_id, "reason": body.get("reason", "")}
            return {**old, "already": False}
        if old["state"] == state and (state == "aborted" or old["winners"] == winners):
            return {**old, "already": True}
        return f"job {job_id!r} is {old['state']}"

    def published(self) -> list[dict[str, Any]]:
        """Winners of committed jobs."""
        return [w for d in self.decisions.values() if d["state"] == "committed"
                for w in d["winners"]]


class FakeServer:
    def __init__(self, path: Path, *, max_inflight: int, batch: int, respond: Responder,
                 hello_error: tuple[int, str] | None, jobs: FakeJobs | None = None,
                 max_bundle_bytes: int = 1 << 20,
                 hold: Callable[[p.BundleFrame], bool] | None = None) -> None:
        self.path, self.max_inflight, self.batch = path, max_inflight, batch
        self.hold = hold or (lambda frame: False)
        self.respond, self.hello_error = respond, hello_error
        self.jobs = jobs or FakeJobs()
        self.max_bundle_bytes = max_bundle_bytes
        self.received: list[p.BundleFrame] = []
        self.received_jobs: list[p.JobRequest] = []
        self.max_pending = 0
        self._sequence = 0
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen()
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True)]
        self._threads[0].start()

    def close(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        for t in list(self._threads):
            t.join(timeout=10)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        decoder = p.FrameDecoder(p.max_frame_bytes(self.max_bundle_bytes))
        pending: list[p.BundleFrame | p.JobRequest] = []
        held: list[p.BundleFrame | p.JobRequest] = []
        rows: dict[Key, int] = {}  # this connection's attempts: next row_offset expected
        with conn:
            while data := conn.recv(65536):
                try:
                    messages = decoder.feed(data)
                except p.ProtocolError as exc:
                    conn.sendall(p.encode_error(0, exc.code, str(exc)))
                    return
                flush = False
                for msg in messages:
                    if isinstance(msg, p.Hello):
                        if self.hello_error is not None:
                            conn.sendall(p.encode_error(0, *self.hello_error))
                            return
                        conn.sendall(p.hello_reply(msg, max_bundle_bytes=self.max_bundle_bytes,
                                                   max_inflight=self.max_inflight))
                        continue
                    if isinstance(msg, p.JobRequest):
                        self.received_jobs.append(msg)
                        flush = True
                    else:
                        assert isinstance(msg, p.BundleFrame)
                        p.validate_bundle(msg)
                        self.received.append(msg)
                        _count_rows(msg, rows)
                        if self.hold(msg):
                            held.append(msg)
                            continue
                    pending.append(msg)
                    self.max_pending = max(self.max_pending, len(pending) + len(held))
                if flush:
                    pending, held = held + pending, []
                if pending and (flush or len(pending) >= self.batch):
                    if not self._answer(conn, pending[::-1], rows):
                        return
                    pending.clear()

    def _answer(self, conn: socket.socket, frames: list[p.BundleFrame | p.JobRequest],
                rows: dict[Key, int]) -> bool:
        for frame in frames:
            if isinstance(frame, p.JobRequest):
                reply: bytes | None = self.jobs.answer(frame, rows)
            else:
                reply = self.respond(frame)
            if reply is None:
                with self._lock:
                    self._sequence += 1
                    reply = p.encode_ack(frame.request_id, 1, self._sequence)
            conn.sendall(reply)
            if reply[4] == p.FrameType.ERROR and reply[9] in p.CLOSES_CONNECTION:
                return False
        return True


def _count_rows(frame: p.BundleFrame, rows: dict[Key, int]) -> None:
    txn = frame.txn
    if txn is None:
        return
    key = (txn.job_id, txn.partition, txn.attempt)
    if rows.get(key, 0) == txn.row_offset:
        rows[key] = txn.row_offset + frame.row_count
    else:
        rows[key] = -1  # out of order: this attempt can never end


def ack_all(frame: p.BundleFrame) -> bytes | None:
    return None
