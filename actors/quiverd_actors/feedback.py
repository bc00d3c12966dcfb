"""A dispatcher's feedback inbox and the outcome batches it sends the ack_logger.

    subscriber connection ──Feedback (one per shard per read batch)──┐
    uploader ──Feedback (one per acked bundle, queued without a yield)┼─▶ FeedbackInbox
                                                                      │   (bounded)
    dispatcher pass: take() ──▶ OutcomeBatch ──RecordOutcome(s)──▶ ack_logger
                                      └── settled once its reply is given

Senders only queue: the session's window, the dispatcher's in-flight table and
its settle list change in the dispatcher's own task, never in a connection's.
Everything queued when a pass begins is applied at once and goes to the
ack_logger as one request, so ack.log gets one append per batch, not per bundle.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from quiverd.kernel.changes import Changes
from quiverd.kernel.reply import Reply
from quiverd_actors.messages import Feedback, RecordOutcome, RecordOutcomes

if TYPE_CHECKING:
    from quiverd_actors.sessions import Session

# Outcomes queued before a sender waits: a subscriber can hold at most its window
# (<= 4096) in flight, so a well-behaved one never waits on a pass.
MAX_QUEUED_OUTCOMES = 4096

OutcomeKey = tuple[str, int, int]  # (subscriber, segment_seq, bundle_index)


class FeedbackInbox:
    """Feedback waiting for the dispatcher's next pass; ``post`` wakes it."""

    def __init__(self, changes: Changes, bound: int = MAX_QUEUED_OUTCOMES) -> None:
        self.changes, self.bound = changes, bound
        self._queue: deque[Feedback] = deque()
        self._queued = 0  # outcomes in ``_queue``
        self._room: anyio.Event | None = None  # set by the next take()
        self._closed = False

    async def post(self, fb: Feedback) -> None:
        """Queue ``fb`` (no yield while there is room); raises ClosedResourceError once
        the dispatcher has stopped (its outcomes would never be applied)."""
        while self._queued >= self.bound and not self._closed:
            # A message larger than the bound still goes in when the queue is empty.
            if self._room is None:
                self._room = anyio.Event()
            await self._room.wait()
        if self._closed:
            raise anyio.ClosedResourceError
        self._queue.append(fb)
        self._queued += len(fb.outcomes)
        self.changes.notify()

    def take(self) -> list[Feedback]:
        """Everything queued, oldest first; senders waiting for room go on."""
        batch = list(self._queue)
        self._queue.clear()
        self._queued = 0
        self._wake_senders()
        return batch

    def close(self) -> None:
        """The dispatcher stopped: what is still queued is dropped (its bundles stay
        pending and are delivered again), later senders hear ClosedResourceError."""
        self._closed = True
        self._queue.clear()
        self._queued = 0
        self._wake_senders()

    def _wake_senders(self) -> None:
        if self._room is not None:
            self._room.set()
            self._room = None


@dataclass(frozen=True, eq=False)
class Outcome:
    """One ack or nack as the dispatcher applied it: who sent it, for which bundle."""

    key: OutcomeKey
    session: Session
    outcome: int


@dataclass(eq=False)
class OutcomeBatch:
    """The outcomes of one pass, sent as one request; settled when its reply is given."""

    items: tuple[Outcome, ...]
    reply: Reply[None] | Reply[tuple[Exception | None, ...]]

    @staticmethod
    def of(items: list[Outcome]) -> tuple[OutcomeBatch, RecordOutcome | RecordOutcomes]:
        """The batch and its request: a lone outcome as ``RecordOutcome``."""
        if len(items) == 1:
            (sub, seg, idx), outcome = items[0].key, items[0].outcome
            one: Reply[None] = Reply()
            return OutcomeBatch((items[0],), one), RecordOutcome(
                subscriber=sub, segment_seq=seg, bundle_index=idx, outcome=outcome, reply=one)
        many: Reply[tuple[Exception | None, ...]] = Reply()
        return OutcomeBatch(tuple(items), many), RecordOutcomes(
            outcomes=tuple((*it.key, it.outcome) for it in items), reply=many)

    def errors(self) -> list[Exception | None]:
        """Per item, why the ack_logger changed nothing for it (None: durable)."""
        assert self.reply.done, "errors() of a batch not yet settled"
        if self.reply.error is not None:
            return [self.reply.error] * len(self.items)
        value = self.reply.result()
        return [None] * len(self.items) if value is None else list(value)


__all__ = ["MAX_QUEUED_OUTCOMES", "FeedbackInbox", "Outcome", "OutcomeBatch"]
