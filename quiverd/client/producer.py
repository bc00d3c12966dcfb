"""Producer clients for quiverd's Unix socket: ``AsyncClient`` (anyio) and ``Client``.

Both speak protocol v1 (``quiverd.protocol``): HELLO, then BUNDLE frames pipelined
up to the server's ``max_inflight``; each bundle is answered by an ACK (durable)
or an ERROR, matched by request id. ERROR frames become quiverd.kernel.errors
exceptions (``AtCapacity``, ``ShuttingDown``, ``Unauthorized``, ``JobConflict``,
``SchemaConflict`` (``lake.schema_mode = "strict"``: the bundle's schema conflicts with
its (client, slot)'s; not retryable), else ``ProtocolError`` with ``.code``); a lost
connection is ``ConnectionError``.

A *named producer* (``Client.connect(path, producer_id="collector-7")``, protocol v3) is
sent exactly once: each bundle is numbered per client name, and on a lost connection
(or a daemon that stops or restarts) the client reconnects, with backoff from 50 ms to
2 s for at most ``reconnect_s`` (60 s), and resends every bundle not yet answered; the
daemon answers one it already holds with its first ACK instead of storing it again.
The numbering is this process's (a random incarnation): a new process starts anew, so
what an earlier process sent and never saw answered is its own to resend or drop.

Transactional writes (SPEC §7, ``quiverd.client.jobs``) are JOB requests on the same
connection, in the same request-id space and window as bundles: ``end_partition``
after an attempt's tagged bundles, then ``commit_job`` / ``abort_job`` on the driver,
and ``wait_visible`` until a committed job's rows are in the lake's catalog.

    async with await AsyncClient.connect(path) as c:
        ack = await c.send(table, client="web")
    with Client.connect(path) as c:
        acks = c.send_many(batches, client="web")
        end = c.end_partition(job_id, 0, attempt, client="web", rows=n, checksum=crc)
"""

from __future__ import annotations

import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, cast

import anyio
import anyio.abc
import msgspec

from quiverd.client.core import (
    Buffer,
    Requests,
    SendData,
    SendItem,
    StrPath,
    connect_blocking,
    encode_request,
    handshake_result,
    split_item,
    tune_socket,
)
from quiverd.client.files import FileSplit, iter_file_batches
from quiverd.client.jobs import (
    EndAck,
    JobResult,
    JobVisibility,
    KeepAliveReply,
    abort_body,
    commit_body,
    end_ack,
    end_partition_body,
    job_result,
    job_status,
    job_visibility,
    keepalive_body,
    keepalive_reply,
    lake_answer,
    lake_body,
    status_body,
    visible_body,
)
from quiverd.kernel.bundle import TxnTag
from quiverd.kernel.errors import DaemonUnreachable, ProtocolError, QuiverError
from quiverd.kernel.jobs import Winner
from quiverd.protocol.codec import (
    REPLY_FRAME_MAX,
    Ack,
    Error,
    ErrorCode,
    FrameDecoder,
    HelloOk,
    JobReply,
    Role,
    encode_hello,
    encode_job_request,
    exception_for,
)

__all__ = [
    "Ack", "AsyncClient", "Client", "EndAck", "FileProgress", "FileSplit", "JobResult",
    "JobVisibility",
    "SendData", "SendItem", "iter_file_batches", "send_files",
]

_END = object()  # end of the items iterator
RECV_BYTES = 64 * 1024  # server frames to producers are small: acks, errors, JOB_OK
RECONNECT_S = 60.0  # a named producer's reconnect attempts, at most this long
BACKOFF_S = (0.05, 2.0)  # first and longest pause between them
# Connection-level ERRORs after which a named producer reconnects and resends.
RESUMABLE = frozenset({ErrorCode.SHUTTING_DOWN, ErrorCode.TIMEOUT})
# Refusals that another connection would get too: reconnecting cannot help.
FINAL = frozenset({ErrorCode.UNAUTHORIZED, ErrorCode.UNSUPPORTED_VERSION,
                   ErrorCode.MALFORMED, ErrorCode.TOO_LARGE})


class _Named:
    """A producer client that may be named (protocol v3: numbered, resent exactly once)."""

    _producer: tuple[str, int] | None  # (producer_id, incarnation)

    def _named(self, producer_id: str, incarnation: int) -> None:
        if producer_id:
            self._producer = (producer_id, incarnation)

    @property
    def producer_id(self) -> str:
        return self._producer[0] if self._producer is not None else ""


class AsyncClient(_Named):
    """anyio producer client; use ``async with await AsyncClient.connect(path) as c``.

    A background reader task (in a task group living inside ``async with``)
    matches ACK/ERROR frames to request ids, so many coroutines may ``send`` at
    once; at most ``server.max_inflight`` bundles are unacknowledged.
    """

    def __init__(self, stream: anyio.abc.SocketStream, hello_ok: HelloOk, decoder: FrameDecoder):
        self.server = hello_ok
        self._stream = stream
        self._decoder = decoder
        self._requests = Requests()
        self._events: dict[int, anyio.Event] = {}
        self._window = anyio.Semaphore(hello_ok.max_inflight)
        self._send_lock = anyio.Lock()
        self._tg: anyio.abc.TaskGroup | None = None
        self._path: StrPath = ""
        self._producer: tuple[str, int] | None = None  # (producer_id, incarnation)
        self.reconnect_s = RECONNECT_S
        self.reconnects = 0
        self._numbered: dict[int, list[Buffer]] = {}  # request id -> frame, not answered
        self._pseq: dict[str, int] = {}

    @classmethod
    async def connect(cls, path: StrPath, *, producer_id: str = "",
                      reconnect_s: float = RECONNECT_S) -> AsyncClient:
        """Connect and say HELLO; ``producer_id``: a named producer, as ``Client``."""
        incarnation = (secrets.randbits(64) or 1) if producer_id else 0
        stream, hello, decoder = await _handshake(path, producer_id, incarnation)
        c = cls(stream, hello, decoder)
        c._path, c.reconnect_s = path, reconnect_s
        c._named(producer_id, incarnation)
        return c

    async def __aenter__(self) -> Self:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._read_loop)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None, "AsyncClient used outside `async with`"
        try:
            self._tg.cancel_scope.cancel()
            return await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            await self._stream.aclose()

    async def send(self, data: SendData, *, client: str, txn: TxnTag | None = None) -> Ack:
        """Send one bundle; returns once the server acked it durably."""
        request_id = await self._submit(data, client, txn)
        return await self._outcome(request_id)

    async def send_many(self, items: Iterable[SendItem], *, client: str) -> list[Ack]:
        """Pipeline bundles (up to max_inflight); acks in input order.

        Sending stops at the first failure seen; that failure is raised once the
        bundles already sent are answered.
        """
        sent: list[int] = []
        for item in items:
            if self._requests.failed_since(sent):
                break
            data, txn = split_item(item)
            sent.append(await self._submit(data, client, txn))
        return [await self._outcome(request_id) for request_id in sent]

    async def end_partition(self, txn_job_id: str, partition: int, attempt: int, *,
                            client: str, rows: int, checksum: int) -> EndAck:
        """Ask for the attempt's end-of-partition marker after its tagged bundles, sent
        on this connection; returns once the marker is durable. The daemon refuses
        (``JobConflict``) when this connection did not send exactly ``rows`` rows of
        the attempt, at contiguous row offsets from 0."""
        body = end_partition_body(txn_job_id, partition, attempt, client=client, rows=rows,
                                  checksum=checksum)
        return end_ack(await self._job(body))

    async def commit_job(self, job_id: str, winners: Sequence[Winner],
                         remote: Sequence[int] = ()) -> JobResult:
        """Publish exactly ``winners`` (one attempt per partition); idempotent."""
        return job_result(await self._job(commit_body(job_id, winners, remote)), "commit")

    async def abort_job(self, job_id: str, reason: str = "") -> JobResult:
        """Discard the job's staged rows; ``JobConflict`` if it was committed."""
        return job_result(await self._job(abort_body(job_id, reason)), "abort")

    async def job_status(self, job_id: str) -> dict[str, Any]:
        return job_status(await self._job(status_body(job_id)))

    async def wait_visible(self, job_id: str, timeout_s: float = 60.0) -> JobVisibility:
        """Until the committed job's rows published by this daemon are in the catalog,
        at most ``timeout_s`` (0: the state now); see ``Client.wait_visible``."""
        return job_visibility(await self._job(visible_body(job_id, timeout_s)))

    async def lake_info(self) -> dict[str, Any]:
        """Where the daemon's catalog and store are, secrets withheld (JOB lake)."""
        return lake_answer(await self._job(lake_body()))

    async def keepalive(self, job_id: str) -> KeepAliveReply:
        """Keep this connection, and ``job_id``'s writer lease, alive (JOB keepalive)."""
        return keepalive_reply(await self._job(keepalive_body(job_id)))

    async def _job(self, body: Mapping[str, Any]) -> dict[str, Any]:
        self._check_open()
        self._requests.check_usable()
        request_id = self._requests.next_id()
        frame = encode_job_request(request_id, body)
        await self._start(request_id, JobReply, [frame])
        await self._wait(request_id)
        return self._requests.take_reply(request_id).body

    def _check_open(self) -> None:
        if self._tg is None:
            raise RuntimeError("use `async with await AsyncClient.connect(path) as c:`")

    async def _submit(self, data: SendData, client: str, txn: TxnTag | None) -> int:
        self._check_open()
        # Encoding is CPU work at memcpy speed, done before waiting for a window slot.
        self._requests.check_usable()
        request_id = self._requests.next_id()
        pseq = self._pseq.get(client, 0) + 1 if self._producer and txn is None else 0
        parts = encode_request(request_id, data, client, txn, self.server, pseq)
        if pseq:
            self._pseq[client] = pseq
        await self._start(request_id, Ack, parts, numbered=bool(pseq))
        return request_id

    async def _start(self, request_id: int, expect: type[Ack] | type[JobReply],
                     parts: list[Buffer], *, numbered: bool = False) -> None:
        """Take a window place for the request and send its frame."""
        await self._window.acquire()
        try:
            self._requests.start(request_id, expect)
        except BaseException:
            self._window.release()
            raise
        self._events[request_id] = anyio.Event()
        async with self._send_lock:
            if numbered:  # under the lock: a reconnect resends it, or this send does
                self._numbered[request_id] = parts
            try:
                for part in parts:
                    # anyio's socket streams send any buffer (they wrap it in a
                    # memoryview); the annotation just says bytes.
                    await self._stream.send(cast(bytes, part))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                if not numbered:
                    self._resolve(self._requests.fail(ConnectionError("send failed")))
                    raise
                # The reader sees the connection gone, reconnects and resends it.
                await anyio.aclose_forcefully(self._stream)
            except BaseException as exc:
                # A frame cut mid-way (cancelled or failed) leaves the stream unusable.
                self._resolve(self._requests.fail(ConnectionError(f"send failed: {exc!r}")))
                raise

    async def _outcome(self, request_id: int) -> Ack:
        await self._wait(request_id)
        return self._requests.take(request_id)

    async def _wait(self, request_id: int) -> None:
        event = self._events.get(request_id)
        try:
            if event is not None:
                await event.wait()
        except BaseException:
            self._requests.forget(request_id)
            raise

    async def _read_loop(self) -> None:
        while True:
            try:
                await self._read()
                return
            except anyio.EndOfStream:
                cause: BaseException = ConnectionError("quiverd closed the connection")
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                cause = ConnectionError(f"connection lost: {exc!r}")
            except ProtocolError as exc:
                self._resolve(self._requests.fail(exc))
                return
            except _Resume as resume:
                cause = resume.cause
            if self._producer is None or not await self._reconnect(cause):
                self._resolve(self._requests.fail(cause))
                return

    async def _read(self) -> None:
        while True:
            data = await self._stream.receive(RECV_BYTES)
            resolved: list[int] = []
            for msg in self._decoder.feed(data):
                if self._producer is not None and isinstance(msg, Error):
                    if msg.request_id == 0 and msg.code in RESUMABLE:
                        self._resolve(resolved)
                        raise _Resume(exception_for(msg))
                    if msg.code == ErrorCode.SHUTTING_DOWN and \
                            msg.request_id in self._numbered:
                        continue  # not stored: resent once the daemon is back
                done = self._requests.on_message(msg)
                for request_id in done:
                    self._numbered.pop(request_id, None)
                resolved += done
            self._resolve(resolved)

    async def _reconnect(self, cause: BaseException) -> bool:
        """As ``Client._reconnect``; False when it gave up (after ``reconnect_s``)."""
        assert self._producer is not None
        async with self._send_lock:
            jobs = [r for r in self._requests.inflight_ids() if r not in self._numbered]
            self._resolve(self._requests.fail_some(jobs, ConnectionError(
                f"the connection was lost before the JOB was answered ({cause}); ask again")))
            deadline = anyio.current_time() + self.reconnect_s
            delay = BACKOFF_S[0]
            while True:
                await anyio.aclose_forcefully(self._stream)
                try:
                    self._stream, self.server, self._decoder = await _handshake(
                        self._path, *self._producer)
                    for parts in list(self._numbered.values()):
                        for part in parts:
                            await self._stream.send(cast(bytes, part))
                except (OSError, QuiverError, anyio.BrokenResourceError,
                        anyio.EndOfStream, ConnectionError) as exc:
                    final = isinstance(exc, ProtocolError) and exc.code in FINAL
                    if final or anyio.current_time() + delay > deadline:
                        self._numbered.clear()
                        return False
                    await anyio.sleep(delay)
                    delay = min(BACKOFF_S[1], delay * 2)
                    cause = exc
                    continue
                self.reconnects += 1
                return True

    def _resolve(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            event = self._events.pop(request_id, None)
            if event is not None:
                event.set()
                self._window.release()


class _Resume(Exception):  # noqa: N818 - a signal inside the reader, never raised out
    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


async def _handshake(path: StrPath, producer: str = "", incarnation: int = 0
                     ) -> tuple[anyio.abc.SocketStream, HelloOk, FrameDecoder]:
    """A connected stream that said HELLO and got HELLO_OK (or the error raised)."""
    try:
        stream = await anyio.connect_unix(path)
    except OSError as exc:
        raise DaemonUnreachable.from_os_error(path, exc) from exc
    try:
        tune_socket(stream.extra(anyio.abc.SocketAttribute.raw_socket))
        await stream.send(encode_hello(Role.PRODUCER, producer=producer,
                                       incarnation=incarnation))
        decoder = FrameDecoder(REPLY_FRAME_MAX, from_client=False)
        while True:
            messages = decoder.feed(await stream.receive(RECV_BYTES))
            if messages:
                return stream, handshake_result(messages), decoder
    except anyio.EndOfStream:
        await anyio.aclose_forcefully(stream)
        raise ConnectionError("quiverd closed the connection during the handshake") from None
    except BaseException:
        await anyio.aclose_forcefully(stream)
        raise


class Client(_Named):
    """Blocking producer client over a plain socket; same API as ``AsyncClient``."""

    def __init__(self, sock: socket.socket, hello_ok: HelloOk, decoder: FrameDecoder) -> None:
        self.server = hello_ok
        self._sock = sock
        self._decoder = decoder
        self._requests = Requests()
        self._recv_buf = bytearray(RECV_BYTES)
        self._path: StrPath = ""
        self._timeout: float | None = None
        self._producer: tuple[str, int] | None = None  # (producer_id, incarnation)
        self.reconnect_s = RECONNECT_S
        self.reconnects = 0  # connections made again (a named producer's)
        self._numbered: dict[int, list[Buffer]] = {}  # request id -> frame, not answered
        self._pseq: dict[str, int] = {}  # client name -> the last producer_seq given

    @classmethod
    def connect(cls, path: StrPath, *, timeout: float | None = None, producer_id: str = "",
                reconnect_s: float = RECONNECT_S) -> Client:
        """Connect and say HELLO. ``producer_id`` names this producer: its bundles are
        then numbered, and a lost connection is made again and what was not answered
        is resent (at most ``reconnect_s`` of attempts), exactly once in all."""
        incarnation = (secrets.randbits(64) or 1) if producer_id else 0
        sock, hello, decoder = connect_blocking(path, Role.PRODUCER, timeout=timeout,
                                                producer=producer_id,
                                                incarnation=incarnation)
        c = cls(sock, hello, decoder)
        c._path, c._timeout, c.reconnect_s = path, timeout, reconnect_s
        c._named(producer_id, incarnation)
        return c

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def send(self, data: SendData, *, client: str, txn: TxnTag | None = None) -> Ack:
        """Send one bundle; returns once the server acked it durably."""
        return self.send_many([(data, txn)], client=client)[0]

    def send_many(self, items: Iterable[SendItem], *, client: str) -> list[Ack]:
        """Pipeline bundles (up to max_inflight); acks in input order."""
        return list(self.iter_send(items, client=client))

    def iter_send(self, items: Iterable[SendItem], *, client: str) -> Iterator[Ack]:
        """Like ``send_many`` but yields each ack in input order as it arrives.

        Sending stops at the first failure; the bundles already in flight are
        drained (so the connection stays usable) and then the failure is raised.
        """
        order: deque[int] = deque()
        source = iter(items)
        more = True
        try:
            while True:
                # A failure already seen stops sending; it is raised when its turn comes.
                while more and len(order) < self.server.max_inflight:
                    if self._requests.failed_since(order):
                        break
                    item = next(source, _END)
                    if item is _END:
                        more = False
                        break
                    order.append(self._submit(cast(SendItem, item), client))
                while order and self._requests.is_done(order[0]):
                    yield self._requests.take(order.popleft())
                if order:
                    self._receive()
                elif not more:
                    return
                else:
                    self._requests.check_usable()  # nothing in flight: raise a broken link
        finally:
            self._drain(order)

    def end_partition(self, txn_job_id: str, partition: int, attempt: int, *, client: str,
                      rows: int, checksum: int) -> EndAck:
        """Ask for the attempt's end-of-partition marker after its tagged bundles, sent
        on this connection; returns once the marker is durable. The daemon refuses
        (``JobConflict``) when this connection did not send exactly ``rows`` rows of
        the attempt, at contiguous row offsets from 0."""
        body = end_partition_body(txn_job_id, partition, attempt, client=client, rows=rows,
                                  checksum=checksum)
        return end_ack(self._job(body))

    def commit_job(self, job_id: str, winners: Sequence[Winner],
                   remote: Sequence[int] = ()) -> JobResult:
        """Publish exactly ``winners`` (one attempt per partition) and discard every other
        attempt of the job. Idempotent: the same commit again gives ``already=True``;
        one contradicting the recorded decision raises ``JobConflict``. A new commit
        whose winner has no end marker on this daemon (or another one) is refused
        (``JobConflict``, naming the partitions), unless its partition is in ``remote``:
        written through another daemon, which checks it."""
        return job_result(self._job(commit_body(job_id, winners, remote)), "commit")

    def abort_job(self, job_id: str, reason: str = "") -> JobResult:
        """Discard the job's staged rows (idempotent); ``JobConflict`` if it was committed."""
        return job_result(self._job(abort_body(job_id, reason)), "abort")

    def job_status(self, job_id: str) -> dict[str, Any]:
        """``{"job_id", "state": staged|unknown|committed|aborted|expired, ...}``."""
        return job_status(self._job(status_body(job_id)))

    def wait_visible(self, job_id: str, timeout_s: float = 60.0) -> JobVisibility:
        """Until every row of the committed job ``job_id`` that this daemon published is
        in a registered lake file (a read sees it), at most ``timeout_s`` (0: the state
        now). The answer's ``visible`` says which; when False, ``reason`` says what is
        pending (the job stays committed and durable). ``JobConflict`` if the job is not
        committed. The daemon reads nothing else on this connection meanwhile."""
        body = visible_body(job_id, timeout_s)
        old = self._sock.gettimeout()
        if old is not None:  # the answer may take the whole timeout
            self._sock.settimeout(max(old, timeout_s + 30))
        try:
            return job_visibility(self._job(body))
        finally:
            self._sock.settimeout(old)

    def lake_info(self) -> dict[str, Any]:
        """Where the daemon's catalog and store are, secrets withheld (docs/protocol.md,
        "Where the lake is"): ``{"data_dir", "catalog", "lake", "withheld", ...}``."""
        return lake_answer(self._job(lake_body()))

    def keepalive(self, job_id: str) -> KeepAliveReply:
        """Keep this connection open through the ingest idle timeout, and ``job_id``'s
        writer lease alive (a job is expired only when no connection holds it), while
        the writer waits for its input; send the next within ``keepalive_ms``."""
        return keepalive_reply(self._job(keepalive_body(job_id)))

    def _job(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Send one JOB and wait for its reply. Bundles an ``iter_send`` left in flight
        keep their place: their answers are kept for it while this one is awaited."""
        self._requests.check_usable()
        request_id = self._requests.next_id()
        frame = encode_job_request(request_id, body)
        while self._requests.inflight >= self.server.max_inflight:
            self._receive()  # a JOB takes a window place like a bundle
        self._requests.start(request_id, JobReply)
        try:
            self._sendall([frame])
        except BaseException as exc:
            self._requests.fail(ConnectionError(f"send failed: {exc!r}"))
            raise
        try:
            while not self._requests.is_done(request_id):
                self._receive()
        except BaseException:
            self._requests.forget(request_id)
            raise
        return self._requests.take_reply(request_id).body

    def _submit(self, item: SendItem, client: str) -> int:
        data, txn = split_item(item)
        request_id = self._requests.next_id()
        # A named producer numbers its bundles (a txn-tagged one has its own tag).
        pseq = self._pseq.get(client, 0) + 1 if self._producer and txn is None else 0
        parts = encode_request(request_id, data, client, txn, self.server, pseq)
        self._requests.start(request_id, Ack)
        if pseq:
            self._pseq[client] = pseq
            self._numbered[request_id] = parts
        try:
            self._sendall(parts)
        except OSError as exc:
            if not self._resumable(exc):
                self._requests.fail(ConnectionError(f"send failed: {exc!r}"))
                raise
            self._reconnect(exc)  # sends it again, with every other one not answered
        except BaseException as exc:
            self._requests.fail(ConnectionError(f"send failed: {exc!r}"))
            raise
        return request_id

    def _resumable(self, exc: BaseException) -> bool:
        """May a named producer reconnect after ``exc``? Not after a timeout (the
        caller's own deadline) nor for a bare connection."""
        return self._producer is not None and not isinstance(exc, TimeoutError)

    def _reconnect(self, cause: BaseException) -> None:
        """Connect again (same producer id and incarnation) and resend every numbered
        bundle not answered yet, in order; a JOB in flight fails (ask it again). Gives up
        after ``reconnect_s``: then every request in flight fails."""
        assert self._producer is not None
        jobs = [r for r in self._requests.inflight_ids() if r not in self._numbered]
        self._requests.fail_some(jobs, ConnectionError(
            f"the connection was lost before the JOB was answered ({cause}); ask again"))
        deadline = time.monotonic() + self.reconnect_s
        delay = BACKOFF_S[0]
        while True:
            self._sock.close()
            try:
                sock, hello, decoder = connect_blocking(
                    self._path, Role.PRODUCER, timeout=self._timeout,
                    producer=self._producer[0], incarnation=self._producer[1])
                self._sock, self.server, self._decoder = sock, hello, decoder
                for parts in list(self._numbered.values()):
                    self._sendall(parts)
            except (OSError, QuiverError) as exc:
                final = isinstance(exc, ProtocolError) and exc.code in FINAL
                if final or time.monotonic() + delay > deadline:
                    self._sock.close()
                    self._requests.fail(ConnectionError(
                        f"the connection to quiverd was lost ({cause}) and could not be "
                        f"made again within {self.reconnect_s:g} s: {exc}"))
                    self._numbered.clear()
                    return
                time.sleep(delay)
                delay = min(BACKOFF_S[1], delay * 2)
                cause = exc
                continue
            self.reconnects += 1
            return

    def _sendall(self, parts: list[Buffer]) -> None:
        # sendmsg gathers the buffers in one syscall; payloads are never joined.
        views = deque(memoryview(p).cast("B") for p in parts)
        while views:
            sent = self._sock.sendmsg(views)
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views.popleft())
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def _receive(self) -> None:
        try:
            n = self._sock.recv_into(self._recv_buf)
        except OSError as exc:
            if self._resumable(exc):
                self._reconnect(exc)
                return
            self._requests.fail(ConnectionError(f"connection lost: {exc!r}"))
            return
        if n == 0:
            if self._producer is not None:
                self._reconnect(ConnectionError("quiverd closed the connection"))
                return
            self._requests.fail(ConnectionError("quiverd closed the connection"))
            return
        try:
            for msg in self._decoder.feed(memoryview(self._recv_buf)[:n]):
                if self._producer is not None and isinstance(msg, Error):
                    if msg.request_id == 0 and msg.code in RESUMABLE:
                        self._reconnect(exception_for(msg))  # the server closes after it
                        return
                    if msg.code == ErrorCode.SHUTTING_DOWN and msg.request_id in \
                            self._numbered:
                        continue  # not stored: resent once the daemon is back
                for request_id in self._requests.on_message(msg):
                    self._numbered.pop(request_id, None)
        except ProtocolError as exc:
            self._requests.fail(exc)

    def _drain(self, order: deque[int]) -> None:
        # An abandoned iterator or an error must not leave answers unread on the wire.
        while order and not self._requests.broken:
            if not self._requests.is_done(order[0]):
                self._receive()
                continue
            self._requests.forget(order.popleft())
        for request_id in order:
            self._requests.forget(request_id)


class FileProgress(msgspec.Struct, frozen=True, kw_only=True):
    """One acked record batch of ``send_files``."""

    path: str
    batch_index: int
    rows: int
    ack: Ack


def send_files(
    socket_path: StrPath,
    paths: Iterable[StrPath],
    *,
    client: str,
    progress: Callable[[FileProgress], None] | None = None,
    timeout: float | None = None,
    splits: list[FileSplit] | None = None,
    producer_id: str = "",
) -> Iterator[Ack]:
    """Send every file as bundles; yields acks in order.

    Files may be Arrow IPC (file or stream format), one bundle per record batch,
    or Parquet, one bundle per row group; a batch or row group larger than the
    daemon's ``max_bundle_bytes`` is cut into row slices that fit. ``splits``, when
    given, receives one ``FileSplit`` per file saying how it was cut. ``progress``
    is called once per acked bundle (the CLI draws its progress line from it).
    ``producer_id`` makes it a named producer (``Client.connect``): exactly once across
    lost connections and daemon restarts.
    """
    # (path, batch index, rows) of each batch in flight, oldest first; bounded
    # by max_inflight because iter_send yields acks in input order.
    sent: deque[tuple[str, int, int]] = deque()

    def batches(max_bundle_bytes: int) -> Iterator[SendItem]:
        for path in paths:
            split = FileSplit(str(path))
            if splits is not None:
                splits.append(split)
            for index, batch in enumerate(iter_file_batches(
                    path, max_bundle_bytes=max_bundle_bytes, split=split)):
                sent.append((str(path), index, batch.num_rows))
                yield batch

    with Client.connect(socket_path, timeout=timeout, producer_id=producer_id) as conn:
        for ack in conn.iter_send(batches(conn.server.max_bundle_bytes), client=client):
            path, index, rows = sent.popleft()
            if progress is not None:
                progress(FileProgress(path=path, batch_index=index, rows=rows, ack=ack))
            yield ack
