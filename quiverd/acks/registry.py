"""The subscriber registry: names, ids and start segments, persisted inside ack.log.

Where it lives: registrations are SUBSCRIBER records in ``ack.log`` and are carried in
every CHECKPOINT, rather than in a separate ``subscribers.json``. One file is then the
whole truth about subscribers: a registration and the outcomes that follow it are
ordered by the same log, so replay can never see an outcome for a subscriber whose
registration is missing, or a registration without the start segment its mark began
from. Two files would need a protocol between them (which is written first, what a
crash between them means); one file needs none. Compaction copies the registry into
the checkpoint, so it survives every rewrite.

Ids are small integers (u32) so OUTCOME records stay 17 bytes; they are never reused,
so an outcome written for a removed subscriber can never land on a newer one.

This module is pure state: ``propose_*`` validate and build records, ``apply`` is the
only mutation, and the caller applies a record only once it is durable.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from quiverd.acks.format import OP_ADD, OP_REMOVE, SubscriberChange
from quiverd.kernel.errors import AtCapacity, QuiverError
from quiverd.kernel.names import validate_subscriber_name

# Every subscriber pins segments and costs a cursor; a few dozen is the realistic
# ceiling, the cap only stops a runaway client.
DEFAULT_MAX_SUBSCRIBERS = 256


class UnknownSubscriber(QuiverError, LookupError):
    """No subscriber of that name is registered."""

    hint = ("list subscribers with `quiverd subscribers list`; "
            "add one with `quiverd subscribers add NAME`")


class SubscriberExists(QuiverError, ValueError):
    """A subscriber of that name is already registered."""

    hint = "pick another name, or remove the old subscriber first"


class Subscriber(msgspec.Struct, frozen=True, kw_only=True):
    subscriber_id: int
    name: str
    start_segment: int  # segments below this count as covered for this subscriber


class SubscriberRegistry:
    """Registered subscribers by name and by id, plus the next id to hand out."""

    def __init__(self, *, max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS) -> None:
        self._by_name: dict[str, Subscriber] = {}
        self._by_id: dict[int, Subscriber] = {}
        self._next_id = 1
        self._max = max_subscribers

    @property
    def next_id(self) -> int:
        return self._next_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Subscriber]:
        """Subscribers in ascending id order (registration order)."""
        return iter(sorted(self._by_id.values(), key=lambda s: s.subscriber_id))

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> Subscriber:
        sub = self._by_name.get(name)
        if sub is None:
            raise UnknownSubscriber(f"no subscriber named {name!r}")
        return sub

    def by_id(self, subscriber_id: int) -> Subscriber | None:
        return self._by_id.get(subscriber_id)

    def propose_add(self, name: str, start_segment: int) -> SubscriberChange:
        """The record registering ``name``. Apply it before proposing another add:
        the id is only taken when the record is applied."""
        validate_subscriber_name(name)
        if name in self._by_name:
            raise SubscriberExists(f"subscriber {name!r} is already registered")
        if len(self._by_id) >= self._max:
            raise AtCapacity(f"{self._max} subscribers are registered, the configured maximum")
        return SubscriberChange(subscriber_id=self._next_id, op=OP_ADD, name=name,
                                start_segment=start_segment)

    def propose_remove(self, name: str) -> SubscriberChange:
        sub = self.get(validate_subscriber_name(name))
        return SubscriberChange(subscriber_id=sub.subscriber_id, op=OP_REMOVE, name=name,
                                start_segment=sub.start_segment)

    def apply(self, change: SubscriberChange) -> Subscriber | None:
        """Apply a durable SUBSCRIBER record; returns the subscriber added or removed."""
        if change.op == OP_ADD:
            if change.name in self._by_name or change.subscriber_id in self._by_id:
                raise ValueError(f"subscriber {change.name!r} (id {change.subscriber_id}) "
                                 "added twice")
            sub = Subscriber(subscriber_id=change.subscriber_id, name=change.name,
                             start_segment=change.start_segment)
            self._by_name[sub.name] = sub
            self._by_id[sub.subscriber_id] = sub
            self._next_id = max(self._next_id, sub.subscriber_id + 1)
            return sub
        if change.op == OP_REMOVE:
            # A remove of an unknown id is a no-op: replaying it twice must be harmless.
            removed = self._by_id.pop(change.subscriber_id, None)
            if removed is not None:
                del self._by_name[removed.name]
            return removed
        raise ValueError(f"unknown subscriber op {change.op}")

    def reset(self, subscribers: list[Subscriber], next_id: int) -> None:
        """Replace everything (a CHECKPOINT is being applied)."""
        self._by_name = {s.name: s for s in subscribers}
        self._by_id = {s.subscriber_id: s for s in subscribers}
        top = max((s.subscriber_id for s in subscribers), default=0)
        self._next_id = max(next_id, top + 1)
