"""The WAL's writer and syncer threads in lock-step with a SimLoop: the product's own code
(``WalPipeline.run_writer``/``run_syncer``, unchanged) runs in real threads, but only
while the loop lends one of them a step, so the seed orders their steps against the
actors' and a replay is exact.

    loop callback StepThread.step ──turn──▶ thread runs to its next blocking point
              (the loop waits)    ◀──back── (a queue get, an Event wait, a sleep) or its end

    blocking point          next step scheduled (loop.call_soon / call_later) when
    SimQueue.get            a put reaches the queue, or the get's timeout (virtual) ran out
    SimEvent.wait           the event is set, or the timeout ran out
    time.sleep(s)           s virtual seconds later (ModelFS's fdatasync latency: the
                            window in which a real fdatasync has not yet returned)
    SimLock.acquire         the holder released it (WalFiles' _lock and _mutex, swapped
                            in after recovery; the loop's thread cannot wait: it runs
                            the holder on, its sleep cut short, until the lock is free)

One thread runs at a time (the loop or one step thread), so nothing races: the loop's
callbacks a thread posts (``call_soon_threadsafe``) are plain ready callbacks. ``patched``
installs it for a run: ``wal_writer.WalPipeline`` becomes ``SimPipeline`` (the same class
with the queues and events above), ``anyio.to_thread.run_sync`` of its two thread
functions starts a StepThread (any other function runs inline, as ``loop.simulated``
does), and ``time.sleep`` is virtual on a step thread and free on the loop's thread (a
callback cannot wait: virtual time does not pass inside one).
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import anyio
import anyio.to_thread

from quiverd_actors import wal_threads, wal_writer

STEP_TIMEOUT_S = 5.0  # real seconds: a step that takes longer is stuck in a real wait
MIN_WAIT_S = 0.0001  # virtual: the shortest timed wait of a step thread
_current = threading.local()  # .thread: the StepThread running on this OS thread


class Abandoned(BaseException):
    """Raised in a step thread the run gave up on (a failed run): it unwinds and ends."""


class StepThread:
    """One real thread that runs only inside the loop's ``step`` callbacks."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str, fn: Callable[[], Any],
                 note: Callable[[str], None]) -> None:
        self.loop, self.name, self.fn, self.note = loop, name, fn, note
        self.turn = threading.Semaphore(0)  # the thread may run
        self.back = threading.Semaphore(0)  # the loop may go on
        self.done: asyncio.Future[Any] = loop.create_future()
        self.finished = self.abandoned = False
        self.stuck = ""  # why a step never came back (a harness failure)
        self.outcome: tuple[bool, Any] = (True, None)
        self.scheduled = False  # a step callback is queued
        self.ready = False  # its wait is over: the next step may run
        self.token = 0  # which wait a timer belongs to
        self.waiting_on: object | None = None
        self.timed_out = False
        self.step = _Step(self, f"{name}.step")
        # The starting task's context variables, as a real thread pool hop would carry
        # them (tests.sim.detsim.daemon routes each daemon's file system calls by one).
        self.context = contextvars.copy_context()

    def start(self) -> None:
        threading.Thread(target=self._main, name=f"sim-{self.name}", daemon=True).start()
        self.wake()

    # ---- the loop's side ----------------------------------------------------------
    def wake(self) -> None:
        """Its condition holds: run its next step when the seed picks it."""
        if self.finished or self.abandoned:
            return
        self.ready = True
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.step)

    def _run_step(self) -> None:
        self.scheduled = False
        if self.finished or not self.ready:
            return  # already run on (by a lock the loop needed)
        self.ready = False
        self.turn.release()
        if not self.back.acquire(timeout=STEP_TIMEOUT_S):  # until it blocks again or ends
            # Raised here, asyncio would only log it: the harness fails the run instead.
            self.stuck = (f"{self.name} did not give the loop back within "
                          f"{STEP_TIMEOUT_S} s (a real wait in a step thread)")
            return
        if self.finished and not self.done.done():
            ok, value = self.outcome
            if ok:
                self.done.set_result(value)
            else:
                self.done.set_exception(value)

    def _timer(self, token: int) -> None:
        if token == self.token and self.waiting_on is not None:
            self.timed_out = True
            self.wake()

    def abandon(self) -> None:
        """Let a thread still waiting unwind (the run is over)."""
        if not self.finished:
            self.abandoned = True
            self.turn.release()

    # ---- the thread's side --------------------------------------------------------
    def _main(self) -> None:
        _current.thread = self
        self.turn.acquire()
        try:
            if self.abandoned:
                raise Abandoned
            self.outcome = (True, self.context.run(self.fn))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            self.outcome = (False, exc if isinstance(exc, Exception) else RuntimeError(
                f"{self.name} ended by {type(exc).__name__}"))
        finally:
            self.finished = True
            self.back.release()

    def block(self, on: object, timeout_s: float | None, what: str) -> bool:
        """Give the loop back until woken (``on`` changed) or ``timeout_s`` virtual
        seconds passed; True if the timeout ended the wait."""
        self.token += 1
        self.waiting_on, self.timed_out = on, False
        if timeout_s is not None:
            # At least MIN_WAIT_S: a wait of ~0 (the syncer's policy can ask for one
            # again and again while the writer's rotation fdatasync runs) spins a real
            # thread while real time passes; here virtual time must pass too.
            self.loop.call_later(max(MIN_WAIT_S, timeout_s), self._timer, self.token)
        self.note(f"{self.name} waits: {what}")
        self.back.release()
        self.turn.acquire()
        self.waiting_on = None
        if self.abandoned:
            raise Abandoned
        return self.timed_out


class _Step:
    """The step callback, named for its thread in the trace (``loop.describe``)."""

    def __init__(self, thread: StepThread, qualname: str) -> None:
        self.thread, self.__qualname__ = thread, qualname

    def __call__(self) -> None:
        self.thread._run_step()


def _me(what: str) -> StepThread:
    t: StepThread | None = getattr(_current, "thread", None)
    if t is None:
        raise RuntimeError(f"{what} would block the simulated loop (not on a step thread)")
    return t


class SimQueue:
    """``queue.SimpleQueue`` for step threads: ``get`` is a blocking point."""

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.waiter: StepThread | None = None

    def put(self, item: Any) -> None:
        self.items.append(item)
        w = self.waiter
        if w is not None and w.waiting_on is self:
            w.wake()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        while not self.items:
            if not block:
                raise queue.Empty
            t = self.waiter = _me("SimQueue.get")
            if t.block(self, timeout, "queue") and not self.items:
                raise queue.Empty
        return self.items.popleft()

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def empty(self) -> bool:
        return not self.items


class SimEvent:
    """``threading.Event`` for step threads: ``wait`` is a blocking point."""

    def __init__(self) -> None:
        self.flag = False
        self.waiters: list[StepThread] = []

    def is_set(self) -> bool:
        return self.flag

    def set(self) -> None:
        self.flag = True
        for w in self.waiters:
            if w.waiting_on is self:
                w.wake()

    def clear(self) -> None:
        self.flag = False

    def wait(self, timeout: float | None = None) -> bool:
        if not self.flag:
            t = _me("SimEvent.wait")
            self.waiters.append(t)
            try:
                t.block(self, timeout, "event")
            finally:
                self.waiters.remove(t)
        return self.flag


class SimLock:
    """``threading.Lock`` shared by step threads and the loop's thread (``WalFiles``'s
    ``_lock`` and ``_mutex``). A step thread that finds it held blocks (a blocking
    point) until it is released. The loop's thread cannot wait: it runs the holder (a
    parked step thread) on, its sleep cut short, until the lock is free."""

    def __init__(self) -> None:
        self.owner: object | None = None
        self.waiters: list[StepThread] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me: object = getattr(_current, "thread", None) or "loop"
        while self.owner is not None:
            if not blocking:
                return False
            if isinstance(me, StepThread):
                self.waiters.append(me)
                try:
                    me.block(self, None, "lock")
                finally:
                    self.waiters.remove(me)
            else:
                self._run_holder()
        self.owner = me
        return True

    def _run_holder(self) -> None:
        """One step of the holder (or of what it waits for) on the loop's thread."""
        holder = self.owner
        if not isinstance(holder, StepThread):
            raise RuntimeError(f"the loop needs a lock held by {holder!r}")
        waits = holder.waiting_on
        if isinstance(waits, SimLock) and waits.owner is not None and not holder.ready:
            waits._run_holder()  # a chain: the holder waits for a lock a sleeper holds
            return
        if isinstance(waits, _SleepToken):
            holder.timed_out = True
            holder.ready = True
        if not holder.ready:
            raise RuntimeError(f"the loop needs a lock held by {holder.name}, which "
                               f"waits for {waits!r}: nothing the loop could cut short")
        holder._run_step()  # a step of its already queued finds nothing to do
        if holder.stuck:
            raise RuntimeError(f"harness: {holder.stuck}, while the loop waited for a lock "
                               "it holds")

    def release(self) -> None:
        assert self.owner is not None, "release of a lock not held"
        self.owner = None
        for w in self.waiters:
            if w.waiting_on is self:
                w.wake()

    def locked(self) -> bool:
        return self.owner is not None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class _SleepToken:
    """What a thread in ``time.sleep`` waits on."""



class SimPipeline(wal_threads.WalPipeline):
    """The product's pipeline, its queues and events swapped for the lock-step ones."""

    # Set per run by ``patched`` (the pipeline is built inside the product's code).
    note: ClassVar[Callable[[str], None]] = print
    threads: ClassVar[list[StepThread]] = []

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.to_writer = SimQueue()  # type: ignore[assignment]
        self.to_syncer = SimQueue()  # type: ignore[assignment]
        self.space = SimEvent()  # type: ignore[assignment]
        self.stopping = SimEvent()  # type: ignore[assignment]

    async def run_thread(self, fn: Callable[[], Any]) -> Any:
        """What ``to_thread.run_sync(fn)`` does for the real threads: wait (shielded,
        as a real thread is never abandoned) until the thread function returns."""
        loop = asyncio.get_running_loop()
        name = "wal-writer" if fn == self.run_writer else "wal-syncer"
        t = StepThread(loop, name, fn, type(self).note)
        self.threads.append(t)
        t.start()
        with anyio.CancelScope(shield=True):
            return await t.done


@contextmanager
def patched(note: Callable[[str], None]) -> Iterator[list[StepThread]]:
    """Lock-step WAL threads for one run (inside ``loop.simulated``); yields the threads
    started, abandoned at exit if still waiting."""
    threads: list[StepThread] = []
    saved = (wal_writer.WalPipeline, anyio.to_thread.run_sync, time.sleep,
             SimPipeline.note, SimPipeline.threads)
    inline = anyio.to_thread.run_sync

    async def run_sync(func: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        owner = getattr(func, "__self__", None)
        if isinstance(owner, SimPipeline) and func.__name__ in ("run_writer", "run_syncer"):
            return await owner.run_thread(func)
        return await inline(func, *args, **kw)

    def sleep(seconds: float) -> None:
        t: StepThread | None = getattr(_current, "thread", None)
        if t is not None:
            t.block(_SleepToken(), seconds, f"sleep {seconds:g} s")
        # On the loop's thread: nothing to wait for (virtual time stands still in a step).

    wal_writer.WalPipeline = SimPipeline  # type: ignore[misc]
    anyio.to_thread.run_sync = run_sync  # type: ignore[assignment]
    time.sleep = sleep  # type: ignore[assignment]
    SimPipeline.note = note
    SimPipeline.threads = threads
    try:
        yield threads
    finally:
        for t in threads:
            t.abandon()
        wal_writer.WalPipeline = saved[0]  # type: ignore[misc]
        anyio.to_thread.run_sync, time.sleep = saved[1], saved[2]
        SimPipeline.note, SimPipeline.threads = saved[3], saved[4]
