"""Reading one connection's frames under the ingest socket's timeouts.

Every wait for the peer's bytes runs under a deadline (``ingest.*_timeout_ms``):

    handshake   HELLO (and a subscriber's SUBSCRIBE) within handshake_timeout_ms
                of the connection being accepted
    stalled     inside a frame: idle_timeout_ms without a byte closes it, so a
                half-sent BUNDLE cannot hold its pending-bytes budget for ever
    idle        between frames with nothing in flight: idle_timeout_ms
    busy        between frames with bundles in flight, or a subscriber attached:
                no deadline (the peer waits for us, not we for it)

The clock only runs while the server waits for the peer: time spent waiting for
window room, budget or a full shard inbox is the server's, never counted. A
deadline that passes raises ``ProtocolError(TIMEOUT)``; ``stop()`` ends the wait
in progress (and every later one) as if the peer had closed.
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


class FrameReader:
    def __init__(self, stream: RawStream, decoder: protocol.FrameDecoder,
                 cfg: IngestConfig) -> None:
        self.stream, self.decoder = stream, decoder
        self.handshake_ms = cfg.handshake_timeout_ms
        self.idle_ms = cfg.idle_timeout_ms
        self.handshake_deadline = anyio.current_time() + cfg.handshake_timeout_ms / 1000
        self.idle_s = cfg.idle_timeout_ms / 1000 if cfg.idle_timeout_ms else math.inf
        stream.send_stall_s = self.idle_s
        self.stopped = False
        self._scope: anyio.CancelScope | None = None
        self._waiting_for: Waiting = "busy"

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
        deadline = self._deadline(phase)
        with anyio.CancelScope(deadline=deadline) as scope:
            self._scope, self._waiting_for = scope, phase
            if self.stopped:
                scope.cancel()
            try:
                got = await self.stream.receive_into(buffer)
            finally:
                self._scope = None
        if scope.cancelled_caught:  # n was never set
            if self.stopped:
                return None
            raise self._timeout(phase, what)
        return self._received(got)

    def _received(self, n: int) -> list[protocol.Message] | None:
        if n == 0:
            if self.decoder.buffered:
                raise ProtocolError(ErrorCode.MALFORMED, "connection ended inside a frame")
            return None
        return self.decoder.buffer_updated(n)

    async def until_stopped(self, wait: Callable[[], Awaitable[None]]) -> bool:
        """Run ``wait`` (for budget) unless ``stop()`` comes first; False if it did.

        Never timed: the server, not the peer, is what this waits for."""
        with anyio.CancelScope() as scope:
            self._scope, self._waiting_for = scope, "budget"
            if self.stopped:
                scope.cancel()
            try:
                await wait()
            finally:
                self._scope = None
            return True
        return False

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
        if phase == "idle" or self.decoder.buffered:
            return anyio.current_time() + self.idle_s
        return math.inf

    def _timeout(self, phase: Phase, what: str) -> ProtocolError:
        if phase == "handshake":
            text = (f"no {what} within {self.handshake_ms} ms of connecting "
                    "(ingest.handshake_timeout_ms)")
        elif self.decoder.buffered:
            text = (f"frame stalled: nothing received for {self.idle_ms} ms with "
                    f"{self.decoder.buffered} of its {self.decoder.expected or '?'} bytes in "
                    "(ingest.idle_timeout_ms)")
        else:
            text = (f"idle for {self.idle_ms} ms with nothing in flight "
                    "(ingest.idle_timeout_ms); connect again to send more")
        return ProtocolError(ErrorCode.TIMEOUT, text)
