"""``Reply[T]``: the one typed answer an actor gives to a request it was sent.

A request that needs an answer carries a ``Reply``; the actor that handles it
calls ``set(value)`` or ``fail(error)`` exactly once, and the requester awaits
``wait()`` (or, when it has many outstanding, checks ``done`` when woken). No
code of the requester runs inside the answering actor: the reply is a value,
not a callback.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class Reply(Generic[T]):
    __slots__ = ("_done", "_value", "_error")

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._value: T | None = None
        self._error: Exception | None = None

    def set(self, value: T) -> None:
        assert not self._done.is_set(), "a reply is given once"
        self._value = value
        self._done.set()

    def fail(self, error: Exception) -> None:
        assert not self._done.is_set(), "a reply is given once"
        self._error = error
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> Exception | None:
        return self._error

    def result(self) -> T:
        """The value (raises the error) of a reply that is ``done``."""
        assert self._done.is_set(), "result() of a reply not yet given"
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    async def wait(self) -> T:
        await self._done.wait()
        return self.result()

    async def settled(self) -> None:
        """Wait until the reply is given, value or error, without raising."""
        await self._done.wait()
