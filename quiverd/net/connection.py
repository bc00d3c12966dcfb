"""One accepted ingest connection: HELLO, then a producer's BUNDLEs in and ACKs out.

A subscriber (HELLO role 2) is handed to ``consumers.serve_subscriber``. For a
producer, two tasks share the connection:

    reader   recv_into → decoder (each BUNDLE or JOB header first reserves its length
             of the pending-bytes budget, within the peer uid's share; none free: stop
             reading until there is, timed as a stall: ``quiverd.net.reader``) → every
             complete frame of that read, in one loop
             pass: validate (schema-only checks once per schema) → window slot →
             lake.schema_mode = "strict": the (client, slot)'s established schema
             (once per schema, ``quiverd.net.established``) → one hand-over per shard
             (``ShardInbox.put``)
    replies  shard WAL writer → Ack/Error (``self.replies``) → release window slots
             and budget → one socket write per group of replies

At most ``max_inflight_per_connection`` bundles are unanswered: a full window stops
reading, which is the producer's backpressure. A protocol error gets an ERROR
frame and the socket is shut at once; bundles already handed to a shard are
still waited for (silently), so their budget comes back only when the WAL writer
is done with their bytes. A JOB frame's budget comes back once it is answered.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

import anyio

from quiverd.kernel.bundle import Bundle
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import ProtocolError, QuiverError
from quiverd.kernel.producers import ProducerTag
from quiverd.net import jobs
from quiverd.net.consumers import serve_subscriber
from quiverd.net.rawsock import RawStream
from quiverd.net.reader import FrameReader
from quiverd.protocol import codec as protocol
from quiverd.protocol.frames import ErrorCode, JobRequest, encode_job_reply
from quiverd_actors.inbox import Batches
from quiverd_actors.messages import AppendRequest, ProducerReply

if TYPE_CHECKING:
    from quiverd.net.ingest import IngestServer

ERROR_SEND_S = 1.0  # an ERROR frame the peer does not take within this is dropped
# A closing ERROR waits this long for the answers of bundles handed over before it:
# a group commit takes milliseconds; a shard held by a full disk must not hold it.
ANSWERS_BEFORE_ERROR_S = 0.5


def shard_of(client: str, shards: int) -> int:
    """Stable across restarts and Python versions (unlike hash())."""
    return crc32c(client.encode()) % shards


class Connection:
    def __init__(self, server: IngestServer, stream: RawStream, uid: int) -> None:
        self.server, self.stream, self.uid = server, stream, uid
        self.decoder = protocol.FrameDecoder(server.max_frame, reserve=self._try_reserve,
                                             pool=server.buffers)
        self.reader = FrameReader(stream, self.decoder, server.cfg,
                                  contention=self._contention)
        self.window_size = server.cfg.max_inflight_per_connection
        self.producer: tuple[str, int] | None = None  # (id, incarnation) its HELLO named
        self.room: anyio.Event | None = None  # set when a full window frees a slot
        self.replies: Batches[ProducerReply] = Batches()  # the WAL writers answer here
        self.reserved: deque[int] = deque()  # budget per frame not yet submitted, in order
        self.inflight: dict[int, int] = {}  # request_id -> its budget bytes, until answered
        self.buffers: dict[int, object] = {}  # request_id -> its pooled receive buffer
        self.held = 0  # all budget this connection holds
        self.send_lock = anyio.Lock()  # ACK batches and ERROR frames never interleave
        self.closed = False  # after a closing ERROR or a dead peer: replies are not sent
        self.attempts = jobs.Attempts()  # transactional writes on this connection
        self.end_requests: set[int] = set()  # request ids of end markers in flight

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._write_replies)
                try:
                    await self._serve()
                finally:
                    self.replies.close()
        finally:
            self._release(self.held)
            if self.server.jobs is not None:
                self.server.jobs.release(id(self))  # its jobs' writer leases end here

    async def send_error(self, request_id: int, exc: ProtocolError) -> None:
        """Best effort: a peer that takes nothing for ERROR_SEND_S does not get it."""
        if self.closed or self.stream.torn:
            return
        with anyio.move_on_after(ERROR_SEND_S, shield=True):
            async with self.send_lock:
                await self.stream.send(protocol.encode_error(request_id, int(exc.code),
                                                             str(exc)))

    async def _serve(self) -> None:
        server = self.server
        try:
            await self._read()
        except ProtocolError as exc:
            server.stats.errors.inc()
            if exc.code == ErrorCode.TIMEOUT:
                server.stats.timeouts.inc()
            server.log.info("ingest_protocol_error", code=int(exc.code), error=str(exc))
            # Frames not handed to a shard are dropped with the decoder: their budget
            # is free now; bundles in flight keep theirs until the WAL writer answers.
            self.decoder.close()
            self.reserved.clear()
            self._release(self.held - sum(self.inflight.values()))
            # The bundles before the bad frame were handed over: their answers go out
            # first, so the ERROR refuses only what came after (bounded: a WAL waiting
            # for disk space does not hold the ERROR back for ever).
            with anyio.move_on_after(ANSWERS_BEFORE_ERROR_S):
                await self._drain()
            await self.send_error(0, exc)
            self._hang_up()
        await self._drain()
        if server.stopping and not self.closed:
            text = ("quiverd is shutting down; unacknowledged deliveries are "
                    "delivered again after the restart"
                    if self.decoder.role == protocol.Role.SUBSCRIBER else
                    "quiverd is shutting down; every bundle acked on this connection "
                    "is durable, resend the rest after restart")
            await self.send_error(0, ProtocolError(ErrorCode.SHUTTING_DOWN, text))

    async def _read(self) -> None:
        frames = await self._hello()
        if frames is None:
            return
        if self.decoder.role == protocol.Role.SUBSCRIBER:
            await serve_subscriber(self.server.hub, self.reader, frames, self.server.log)
            return
        while frames is not None:
            await self._submit_all(frames)
            frames = await self.reader.receive("busy" if self.inflight else "idle")

    async def _hello(self) -> list[protocol.Message] | None:
        frames: list[protocol.Message] = []
        while not frames:
            got = await self.reader.receive("handshake")
            if got is None:
                return None
            frames = got
        hello = frames.pop(0)
        if not isinstance(hello, protocol.Hello):  # the decoder already insists on it
            raise ProtocolError(ErrorCode.MALFORMED, "the first frame must be HELLO")
        version = protocol.negotiate(hello)  # raises UNSUPPORTED_VERSION
        if hello.producer:  # a named producer: its bundles are numbered (version 3)
            self.producer = (hello.producer, hello.incarnation)
        cfg = self.server.cfg
        async with self.send_lock:
            await self.stream.send(protocol.encode_hello_ok(
                version=version, max_bundle_bytes=cfg.max_bundle_bytes,
                max_inflight=cfg.max_inflight_per_connection))
        return frames

    async def _submit_all(self, frames: list[protocol.Message]) -> None:
        """Submit decoded frames; then, if the decoder paused on a frame's budget, wait
        for it (not reading meanwhile) and go on with what the decoder held back."""
        while True:
            bundles: list[protocol.BundleFrame] = []
            for frame in frames:
                if isinstance(frame, protocol.BundleFrame):
                    bundles.append(frame)
                elif isinstance(frame, JobRequest):
                    if bundles:  # in order: an end marker follows its attempt's bundles
                        await self._submit(bundles)
                        bundles = []
                    nbytes = self.reserved.popleft()  # reserved in frame order, like bundles
                    await self._job(frame)
                    self._release(nbytes)  # answered: its body and request are gone
                else:
                    raise ProtocolError(ErrorCode.MALFORMED, "only BUNDLE and JOB frames may "
                                        "follow HELLO on a producer connection")
            if bundles:
                await self._submit(bundles)
            need = self.decoder.awaiting
            if need is None:
                return
            if not await self.reader.wait_for_budget(partial(self._reserve, need),
                                                     partial(self._budget_timeout, need)):
                return  # stopping: the next receive ends the loop
            frames = self.decoder.resume()
            if frames:  # the frame that waited is complete: its stall is over
                self.reader.frame_done()

    async def _submit(self, frames: list[protocol.BundleFrame]) -> None:
        """One read batch's bundles: validated here, on the loop (no thread hop), and
        handed to their shards with one ``put`` per shard. A bad frame is refused
        (ProtocolError) after the good ones before it went to their shards."""
        server = self.server
        shards = len(server.inboxes)
        by_shard: dict[int, list[AppendRequest]] = {}
        try:
            for frame in frames:
                nbytes = self.reserved.popleft()
                buffer = self.decoder.taken.popleft()
                slots = protocol.validate_bundle(
                    frame, max_bundle_bytes=server.cfg.max_bundle_bytes, schemas=server.schemas)
                # lake.schema_mode = "strict": a set lookup unless the schema is new here
                # (before the frame takes a window slot: a damaged record raises).
                est = server.established
                conflict = "" if est is None or est.accepts(frame.client, slots) \
                    else await est.check(frame.client, slots)
                if frame.request_id in self.inflight:
                    raise ProtocolError(ErrorCode.MALFORMED, f"request_id {frame.request_id} "
                                        "is already in flight on this connection")
                if len(self.inflight) >= self.window_size:
                    await self._hand_over(by_shard)  # they must go to be answered
                    await self._window_room()
                self.inflight[frame.request_id] = nbytes
                if buffer is not None:
                    self.buffers[frame.request_id] = buffer
                server.stats.bundles.inc()
                if frame.txn is not None:
                    await self._hand_over(by_shard)  # in order with its staging check
                    refusal, code = await self._staging_refusal(frame)
                    if not refusal and conflict:
                        refusal, code = conflict, ErrorCode.SCHEMA_CONFLICT
                    self.attempts.took(frame, sum(s.row_count for s in slots))
                    if refusal:  # never acked; the attempt can no longer end
                        self.replies.send_nowait(protocol.Error(
                            request_id=frame.request_id, code=code, message=refusal))
                        continue
                elif conflict:  # never acked, nothing stored
                    self.replies.send_nowait(protocol.Error(
                        request_id=frame.request_id, code=ErrorCode.SCHEMA_CONFLICT,
                        message=conflict))
                    continue
                tag = None
                if frame.producer_seq:
                    if self.producer is None:
                        raise ProtocolError(ErrorCode.MALFORMED, "BUNDLE has a producer_seq, "
                                            "but this connection's HELLO named no producer")
                    tag = ProducerTag(producer=self.producer[0], incarnation=self.producer[1],
                                      seq=frame.producer_seq)
                bundle = Bundle(client=frame.client, slots=slots, txn=frame.txn, producer=tag)
                by_shard.setdefault(shard_of(frame.client, shards), []).append(AppendRequest(
                    request_id=frame.request_id, bundle=bundle, reply=self.replies))
        finally:
            await self._hand_over(by_shard)

    async def _hand_over(self, by_shard: dict[int, list[AppendRequest]]) -> None:
        for shard, reqs in by_shard.items():
            await self.server.inboxes[shard].put(reqs)
        by_shard.clear()

    async def _window_room(self) -> None:
        """Wait until the in-flight window has a free slot (the producer's backpressure)."""
        while len(self.inflight) >= self.window_size:
            self.room = anyio.Event()
            await self.room.wait()

    async def _write_replies(self) -> None:
        """One socket write per group of replies (a group commit acks many at once)."""
        while (replies := await self.replies.take()) is not None:
            self._answered(replies)
            if self.closed:
                continue  # answers after a closing ERROR are not sent (docs/protocol.md)
            frames = b"".join([self._encode_reply(r) for r in replies])
            try:
                await self._send_locked(frames)
            except anyio.BrokenResourceError:
                self._hang_up()  # the reader sees end of stream and finishes up

    async def _send_locked(self, data: bytes) -> None:
        """``send`` under ``send_lock``; an uncontended lock costs no extra loop turn
        (``async with`` yields once even then, and this runs once per commit)."""
        try:
            self.send_lock.acquire_nowait()
        except anyio.WouldBlock:
            await self.send_lock.acquire()
        try:
            await self.stream.send(data)
        finally:
            self.send_lock.release()

    def _answered(self, replies: Iterable[ProducerReply]) -> None:
        """Give back each answered bundle's window slot, budget and receive buffer."""
        give = self.server.buffers.give
        freed = 0
        for r in replies:
            freed += self.inflight.pop(r.request_id)
            # Answered: the WAL has the bytes (or never will), nothing reads them.
            give(self.buffers.pop(r.request_id, None))
            if self.attempts.pending:
                self.attempts.answered_one(r.request_id, isinstance(r, protocol.Ack),
                                           getattr(r, "message", ""))
        self._release(freed)
        if self.room is not None:
            self.room.set()
        if not self.inflight:
            self.reader.went_idle()

    async def _staging_refusal(self, frame: protocol.BundleFrame) -> tuple[str, ErrorCode]:
        """Why a tagged bundle is refused: its job was decided before its attempt began
        here (a straggler or a replay), or undecided jobs fill the size cap."""
        jobs_ = self.server.jobs
        if jobs_ is None:
            return "", ErrorCode.INTERNAL
        key = _key(frame)
        if self.attempts.is_new(frame):
            jobs_.hold(key[0], id(self))  # a live writer: its job is not expired
            decided = await jobs_.refusal_for(key[0])
            if decided:
                self.attempts.decided[key] = decided
        if key in self.attempts.decided:
            return self.attempts.decided[key], ErrorCode.JOB_CONFLICT
        return jobs_.refusal(), ErrorCode.AT_CAPACITY

    async def _job(self, frame: JobRequest) -> None:
        """One JOB request: an end marker goes the bundles' way (WAL, then JOB_OK);
        commit, abort, status and lake are answered here. A refusal is an ERROR frame."""
        try:
            req = jobs.parse(frame.body)
            if isinstance(req, jobs.EndPartition):
                if self.server.jobs is not None:
                    self.server.jobs.hold(req.job_id, id(self))
                await self._end_partition(frame.request_id, req)
                return
            body = await jobs.answer(self.server.jobs, req, lake=self.server.lake,
                                     holder=id(self))
        except ProtocolError:
            raise
        except (QuiverError, ValueError) as exc:
            await self.send_error(frame.request_id, ProtocolError(jobs.error_code(exc),
                                                                  _with_hint(exc)))
            return
        async with self.send_lock:
            await self.stream.send(encode_job_reply(frame.request_id, body))

    async def _end_partition(self, request_id: int, req: jobs.EndPartition) -> None:
        if request_id in self.inflight:
            raise ProtocolError(ErrorCode.MALFORMED, f"request_id {request_id} is already "
                                "in flight on this connection")
        key = (req.job_id, req.partition, req.attempt)
        await self.attempts.settled(key)  # every bundle of the attempt answered first
        self.attempts.check_end(req)  # JobConflict: answered as an ERROR by _job
        self.attempts.ended.add(key)
        await self._window_room()
        self.inflight[request_id] = 0
        self.end_requests.add(request_id)
        await self.server.inboxes[shard_of(req.client, len(self.server.inboxes))].put((
            AppendRequest(request_id=request_id, bundle=jobs.marker_bundle(req),
                          reply=self.replies),))

    def _encode_reply(self, reply: ProducerReply) -> bytes:
        if reply.request_id in self.end_requests:
            self.end_requests.discard(reply.request_id)
            if isinstance(reply, protocol.Ack):
                node = self.server.jobs.node_id if self.server.jobs else ""
                return encode_job_reply(reply.request_id, {
                    "node_id": node, "shard": reply.shard, "sequence": reply.sequence})
        return _encode_reply(reply)

    async def _drain(self) -> None:
        """Wait until every bundle handed to a shard is answered."""
        while self.inflight:
            self.room = anyio.Event()
            await self.room.wait()

    def _hang_up(self) -> None:
        self.closed = True
        self.server.release_slot(self)
        self.stream.shutdown()

    def _try_reserve(self, nbytes: int) -> bool:
        budget = self.server.budget
        if not budget.try_take(nbytes, self.uid):
            return False
        self._took(nbytes)
        return True

    async def _reserve(self, nbytes: int) -> None:
        budget = self.server.budget
        self.server.stats.budget_waits.inc()
        if budget.by_uid.get(self.uid, 0) + nbytes > budget.per_uid_bytes:
            self.server.log_share_full(self.uid)
        await budget.take(nbytes, self.uid, queued=self.server.budget_contended)
        self._took(nbytes)

    def _contention(self) -> str:
        """What the frame being received holds that a frame waiting for budget needs
        ("" if it holds none, or nobody waits for it): ``quiverd.net.reader``."""
        budget = self.server.budget
        if not self.reserved or not budget.contended(self.uid):
            return ""
        return f"{self.reserved[-1]} bytes; {self._budget_state()}"

    def _budget_timeout(self, nbytes: int, waited_ms: int) -> str:
        return (f"frame stalled: waited {waited_ms} ms for {nbytes} bytes of the pending-bytes "
                f"budget (ingest.idle_timeout_ms), nothing of it read; {self._budget_state()}; "
                "resend it once this peer's earlier frames are answered")

    def _budget_state(self) -> str:
        budget = self.server.budget
        return (f"uid {self.uid} holds {budget.by_uid.get(self.uid, 0)} of its "
                f"{budget.per_uid_bytes}-byte share (ingest.max_pending_bytes_per_uid), "
                f"{budget.held} of {budget.total_bytes} bytes are held in all "
                "(ingest.max_pending_bytes)")

    def _took(self, nbytes: int) -> None:
        self.held += nbytes
        self.reserved.append(nbytes)
        self.server.stats.pending_bytes.set(self.server.budget.held)

    def _release(self, nbytes: int) -> None:
        if nbytes:
            self.held -= nbytes
            self.server.budget.release(nbytes, self.uid)
            self.server.stats.pending_bytes.set(self.server.budget.held)


def _encode_reply(reply: ProducerReply) -> bytes:
    if isinstance(reply, protocol.Ack):
        return protocol.encode_ack(reply.request_id, reply.shard, reply.sequence)
    return protocol.encode_error(reply.request_id, reply.code, reply.message)


def _key(frame: protocol.BundleFrame) -> tuple[str, int, int]:
    assert frame.txn is not None
    return (frame.txn.job_id, frame.txn.partition, frame.txn.attempt)


def _with_hint(exc: Exception) -> str:
    hint = getattr(exc, "hint", "")
    return f"{exc} (hint: {hint})" if hint else str(exc)
