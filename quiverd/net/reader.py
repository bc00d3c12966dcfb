"""Reading one connection's frames under the ingest socket's timeouts.

Every wait for the peer's bytes runs under a deadline (``ingest.*_timeout_ms``):

    handshake   HELLO (and a subscriber's SUBSCRIBE) within handshake_timeout_ms
                of the connection being accepted
    stalled     inside a frame: idle_timeout_ms without a byte closes it, so a
                half-sent BUNDLE cannot hold its pending-bytes budget for ever;
                CONTENDED_STALL_MS (at most idle_timeout_ms / 2) while another frame
                waits for the budget it holds (``ByteBudget.contended``)
    budget      a frame whose header is in but whose budget is not: it is stalled
                from the moment it waits, on the same idle_timeout_ms clock, which
                the grant does not restart (only bytes from the peer do)
    idle        between frames with nothing in flight: idle_timeout_ms
    busy        between frames with bundles in flight, or a subscriber attached:
                no deadline (the peer waits for us, not we for it)

Why a frame waiting for budget is timed (issue 26): its uid's share may be held by
frames of its own that stall, and frames granted after them stall in turn, so a small
bundle queued behind nine stalled 64 MiB frames got no ACK for 90 s and more. Timed,
a wait ends within idle_timeout_ms; the contended stall limit makes a stalled frame
give up what others wait for within about a second, so the uid's other connections
go on. A peer streaming a frame never pauses for a second: only a stalled one loses.

Otherwise the clock only runs while the server waits for the peer: time spent waiting
for window room or a full shard inbox is the server's, never counted. A deadline that
passes raises ``ProtocolError(TIMEOUT)``; ``stop()`` ends the wait in progress (and
every later one) as if the peer had closed.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Literal

import anyio
import anyio.lowlevel

from quiverd.kernel.config import IngestConfig
from quiverd.kernel.errors import ProtocolError
from quiverd.net.rawsock import RawStream
from quiverd.protocol import codec as protocol
from quiverd.protocol.frames import ErrorCode

Phase = Literal["handshake", "idle", "busy"]
Waiting = Literal["handshake", "idle", "busy", "budget"]
# A stalled frame holding budget another frame waits for is closed after this long
# without a byte (module docstring); a frame being sent never pauses this long.
CONTENDED_STALL_MS = 1_000


class FrameReader:
    def __init__(self, stream: RawStream, decoder: protocol.FrameDecoder,
                 cfg: IngestConfig, contention: Callable[[], str] | None = None) -> None:
        """``contention``: "" unless the frame being received holds budget another frame
        waits for; then what it holds, for the timeout's message."""
        self.stream, self.decoder = stream, decoder
        self.handshake_ms = cfg.handshake_timeout_ms
        self.idle_ms = cfg.idle_timeout_ms
        self.handshake_deadline = anyio.current_time() + cfg.handshake_timeout_ms / 1000
        self.idle_s = cfg.idle_timeout_ms / 1000 if cfg.idle_timeout_ms else math.inf
        # idle_timeout_ms = 0 turns every stall limit off, this one too.
        # Half the idle clock at most: a frame waiting for the budget a stalled frame holds
        # is itself timed on idle_timeout_ms, so the holder must give way well before.
        self.contended_s = min(self.idle_s / 2, CONTENDED_STALL_MS / 1000) \
            if cfg.idle_timeout_ms else math.inf
        stream.send_stall_s = self.idle_s
        self.stopped = False
        self._contention = contention or (lambda: "")
        self._scope: anyio.CancelScope | None = None
        self._waiting_for: Waiting = "busy"
        # When the server began waiting for the peer's next byte (None: bytes came in
        # since); kept across a wait for budget and its grant (module docstring).
        self._since: float | None = None

    def stop(self) -> None:
        """End the wait in progress and refuse later ones (the daemon stops reading)."""
        self.stopped = True
        if self._scope is not None:
            self._scope.cancel()

    async def receive(self, phase: Phase, what: str = "HELLO") -> list[protocol.Message] | None:
        """Frames from one ``recv_into``: None at end of stream or after ``stop()``.

        ``phase`` picks the deadline (module docstring); ``what`` names the frame a
        handshake waits for, in the timeout's message.
        """
        await anyio.lowlevel.checkpoint()  # other connections and actors get a turn
        if self.stopped:
            return None
        buffer = self.decoder.get_buffer()
        n = self.stream.try_receive_into(buffer)
        if n is not None:  # under load the bytes are already there: no deadline to arm
            return self._received(n)
        if self._since is None or not self.decoder.buffered:
            self._since = anyio.current_time()
        while True:
            with anyio.CancelScope(deadline=self._deadline(phase)) as scope:
                self._scope, self._waiting_for = scope, phase
                if self.stopped:
                    scope.cancel()
                try:
                    got = await self.stream.receive_into(buffer)
                finally:
                    self._scope = None
            if not scope.cancelled_caught:
                return self._received(got)
            if self.stopped:
                return None
            contention = self._contention() if self.decoder.buffered else ""
            if phase != "handshake" and self.decoder.buffered and not contention \
                    and anyio.current_time() < self._since + self.idle_s:
                continue  # cut short for a contention that has ended: the stall goes on
            raise self._timeout(phase, what, contention)

    def contended(self) -> None:
        """Another frame started waiting for budget: if the frame being received holds
        some it needs, its stall ends after ``contended_s`` (``ByteBudget.contended``)."""
        scope = self._scope
        if scope is not None and self._waiting_for in ("idle", "busy") \
                and self.decoder.buffered and self._since is not None and self._contention():
            scope.deadline = min(scope.deadline, self._since + self.contended_s)

    def frame_done(self) -> None:
        """The frame that waited for budget is complete: its stall clock is done."""
        self._since = None

    def _received(self, n: int) -> list[protocol.Message] | None:
        self._since = None
        if n == 0:
            if self.decoder.buffered:
                raise ProtocolError(ErrorCode.MALFORMED, "connection ended inside a frame")
            return None
        return self.decoder.buffer_updated(n)

    async def wait_for_budget(self, wait: Callable[[], Awaitable[None]],
                            why: Callable[[int], str]) -> bool:
        """Run ``wait`` (for a frame's budget) unless ``stop()`` comes first (False).

        Timed as a stall from now (module docstring): past ``idle_timeout_ms`` it raises
        ``ProtocolError(TIMEOUT)`` with ``why(waited_ms)`` (which budget it waited for)."""
        self._since = anyio.current_time()
        with anyio.CancelScope(deadline=self._since + self.idle_s) as scope:
            self._scope, self._waiting_for = scope, "budget"
            if self.stopped:
                scope.cancel()
            try:
                await wait()
            finally:
                self._scope = None
            return True
        if self.stopped:
            return False
        waited_ms = round((anyio.current_time() - self._since) * 1000)
        raise ProtocolError(ErrorCode.TIMEOUT, why(waited_ms))

    def went_idle(self) -> None:
        """Nothing is in flight any more: a wait between frames now has a deadline."""
        scope = self._scope
        if scope is not None and self._waiting_for == "busy" and scope.deadline == math.inf \
                and not self.decoder.buffered and not self.stopped:
            self._waiting_for = "idle"
            scope.deadline = anyio.current_time() + self.idle_s

    def _deadline(self, phase: Phase) -> float:
        if phase == "handshake":
            return self.handshake_deadline
        since = anyio.current_time() if self._since is None else self._since
        if self.decoder.buffered:
            return since + (self.contended_s if self._contention() else self.idle_s)
        if phase == "idle":
            return since + self.idle_s
        return math.inf

    def _timeout(self, phase: Phase, what: str, contention: str = "") -> ProtocolError:
        if phase == "handshake":
            text = (f"no {what} within {self.handshake_ms} ms of connecting "
                    "(ingest.handshake_timeout_ms)")
        elif contention:
            stalled_ms = round((anyio.current_time() - (self._since or 0.0)) * 1000)
            text = (f"frame stalled: nothing received for {stalled_ms} ms with "
                    f"{self.decoder.buffered} of its {self.decoder.expected or '?'} bytes in, "
                    f"while other frames wait for the budget it holds ({contention}); a "
                    f"stalled frame gives that up after {round(self.contended_s * 1000)} ms: "
                    "resend it")
        elif self.decoder.buffered:
            text = (f"frame stalled: nothing received for {self.idle_ms} ms with "
                    f"{self.decoder.buffered} of its {self.decoder.expected or '?'} bytes in "
                    "(ingest.idle_timeout_ms)")
        else:
            text = (f"idle for {self.idle_ms} ms with nothing in flight "
                    "(ingest.idle_timeout_ms); connect again to send more")
        return ProtocolError(ErrorCode.TIMEOUT, text)
