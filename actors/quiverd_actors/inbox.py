"""A shard's inbox: appends waiting for its WAL writer, handed over once per read batch.

    connection ──put(every bundle of one read batch for this shard)──▶ ShardInbox
    wal_writer ◀──take(): everything pending at once─────────────────┘

Not an anyio memory stream: a stream costs a send (checkpoint, cancel scope) per
bundle; here a connection hands over all of a read batch's bundles for the shard
in one call that never suspends, and the writer takes all that is pending in one
call. The inbox itself is unbounded on purpose: what bounds it is upstream, where
every bundle holds a slot of its connection's in-flight window and its bytes of
the pending-bytes budget until it is answered, so at most
``max_connections × max_inflight_per_connection`` requests are ever here.

``aclose`` keeps the memory stream's name; the ingest server wraps a plain stream
(tests' stand-in WAL writers) in ``StreamInbox`` so it treats both alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from quiverd_actors.messages import AppendRequest

T = TypeVar("T")


class Inbox(Protocol):
    """What a connection hands a shard's bundles to."""

    async def put(self, reqs: Iterable[AppendRequest]) -> None: ...

    async def aclose(self) -> None: ...


class Batches(Generic[T]):
    """A plain FIFO taken whole: any number of puts, then one ``take`` of them all.

    Loop-only (no locks). ``take`` waits for the first item; ``None`` once closed
    and empty. Used for a shard's appends and a connection's replies.
    """

    def __init__(self) -> None:
        self._items: list[T] = []
        self._closed = False
        self._waiter: anyio.Event | None = None

    def put_nowait(self, items: Iterable[T]) -> None:
        """Queue ``items`` in order; ClosedResourceError once closed."""
        if self._closed:
            raise anyio.ClosedResourceError
        self._items.extend(items)
        self._wake()

    def send_nowait(self, item: T) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        self._items.append(item)
        self._wake()

    def close(self) -> None:
        """No more items: ``take`` returns what is queued, then None."""
        self._closed = True
        self._wake()

    @property
    def empty(self) -> bool:
        return not self._items

    async def take(self) -> list[T] | None:
        """Every queued item, in order (waiting for one); None once closed and empty."""
        while not self._items:
            if self._closed:
                return None
            self._waiter = anyio.Event()
            try:
                await self._waiter.wait()
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items

    def _wake(self) -> None:
        if self._waiter is not None:
            self._waiter.set()


class ShardInbox(Batches[AppendRequest]):
    async def put(self, reqs: Iterable[AppendRequest]) -> None:
        self.put_nowait(reqs)

    async def aclose(self) -> None:
        self.close()

    async def pump(self, stream: MemoryObjectReceiveStream[AppendRequest]) -> None:
        """Feed this inbox from a memory stream until it ends, then close it: lets
        ``wal_writer.run`` take a plain stream (tests drive it that way)."""
        try:
            async with stream:
                async for req in stream:
                    batch = [req]
                    while True:  # what is already buffered goes as one batch
                        try:
                            batch.append(stream.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    self.put_nowait(batch)
        finally:
            self.close()


class StreamInbox:
    """A memory stream as an ``Inbox`` (one send per request): for stand-in writers."""

    def __init__(self, stream: MemoryObjectSendStream[AppendRequest]) -> None:
        self.stream = stream

    async def put(self, reqs: Iterable[AppendRequest]) -> None:
        for req in reqs:
            await self.stream.send(req)

    async def aclose(self) -> None:
        await self.stream.aclose()


def as_inbox(target: Inbox | MemoryObjectSendStream[AppendRequest]) -> Inbox:
    return StreamInbox(target) if isinstance(target, MemoryObjectSendStream) else target
