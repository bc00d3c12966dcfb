"""A seeded asyncio event loop with a virtual clock, and the patches that make a run of
real lake code replay exactly from its seed.

    SimLoop._run_once (one *step*):
      due timers ──▶ ready ──rng.randrange──▶ ONE callback runs ──▶ on_step(label)
      nothing ready: virtual time jumps to the next timer (``anyio.sleep(60)`` is free)

``simulated(seed, loop)`` patches, for the run only:
  * ``time.time``/``time_ns``/``monotonic`` read the loop's virtual clock (wall clock =
    ``EPOCH_NS`` + virtual time), so catalog timestamps, grace periods, snapshot ages and
    the janitor's and expiry's windows are virtual and reproducible;
  * ULIDs (file ids, source ids) and ``uuid.uuid4`` (pyiceberg's snapshot ids, metadata
    names) come from seeded generators; the global ``random`` (backoff jitter) is seeded;
  * ``anyio.to_thread.run_sync`` runs its function inline, between two checkpoints: each
    blocking call is atomic, and the only interleaving points are awaits.

Hash order of ``str`` sets depends on PYTHONHASHSEED: a replay in another process gives
the same trace only with the same PYTHONHASHSEED (the test and ``python -m
tests.sim.detsim`` use 0).
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import random
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import ulid

# Virtual t=0 is 2026-01-01T00:57Z: the hour turns at t=180 s (files split by hour, and
# compaction merges per hour). Before any real mtime here: staging files never look stale
# to the janitor (a limit of the sim).
EPOCH_NS = (1_767_225_600 + 57 * 60) * 1_000_000_000
NS = 1_000_000_000
PRODUCT = ("/quiverd/", "/quiverd_actors/")  # a step is labelled by its deepest frame here


class Deadlock(RuntimeError):
    """Nothing is ready and no timer is due: the run can never go on."""


class SimLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock is virtual and whose ready callbacks run one per step, in
    an order drawn from ``rng``."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng
        self.vtime = 0.0
        self.steps = 0
        self.on_step: Callable[[str], None] | None = None
        # Tasks numbered in creation order: the order in which their steps became ready
        # can come from iterating a set of tasks (anyio's cancel delivery), whose order
        # is their memory addresses'. Ready task steps are ranked by this number instead.
        self.task_seq: weakref.WeakKeyDictionary[asyncio.Task[Any], int] = \
            weakref.WeakKeyDictionary()
        self._seq = itertools.count()
        self.set_task_factory(self._new_task)

    def _new_task(self, loop: asyncio.AbstractEventLoop, coro: Any,
                  context: Any = None) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, context=context)
        self.task_seq[task] = next(self._seq)
        return task

    def time(self) -> float:
        return self.vtime

    def wall_ns(self) -> int:
        return EPOCH_NS + int(self.vtime * NS)

    def _run_once(self) -> None:  # noqa: C901 - mirrors BaseEventLoop._run_once
        sched: list[Any] = self._scheduled  # type: ignore[attr-defined]
        ready: Any = self._ready  # type: ignore[attr-defined]
        while sched and sched[0]._cancelled:
            handle = heapq.heappop(sched)
            handle._scheduled = False
            self._timer_cancelled_count -= 1  # type: ignore[attr-defined]
        # Real file descriptors (the self-pipe): polled, never waited on.
        self._process_events(self._selector.select(0))  # type: ignore[attr-defined]
        if not ready and sched:
            self.vtime = max(self.vtime, sched[0]._when)
        end = self.vtime + self._clock_resolution  # type: ignore[attr-defined]
        while sched and sched[0]._when < end:
            handle = heapq.heappop(sched)
            handle._scheduled = False
            ready.append(handle)
        if not ready:
            if self._stopping:  # type: ignore[attr-defined]
                return
            raise Deadlock(f"no callback ready and no timer at virtual t={self.vtime:.3f}")
        pick = self._canonical(ready)[self.rng.randrange(len(ready))]
        ready.rotate(-pick)
        handle = ready.popleft()
        ready.rotate(pick)
        if handle._cancelled:
            return
        self.steps += 1
        label = describe(handle)
        handle._run()
        if self.on_step is not None:
            self.on_step(label)


    def _canonical(self, ready: Any) -> list[int]:
        """Indexes of ``ready`` in an order that is the same in every run: other callbacks
        in their queue order, then task steps by task number."""
        def rank(i: int) -> tuple[int, int]:
            task = getattr(getattr(ready[i], "_callback", None), "__self__", None)
            if isinstance(task, asyncio.Task):
                return (1, self.task_seq.get(task, -1))
            return (0, i)

        return sorted(range(len(ready)), key=rank)


def describe(handle: asyncio.Handle) -> str:
    """What a callback is, the same in every run: the innermost coroutine a task's step
    resumes (function and line), or the callback's qualified name."""
    callback = getattr(handle, "_callback", None)
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        coro: Any = task.get_coro()
        outer = product = harness = inner = ""
        while coro is not None and getattr(coro, "cr_frame", None) is not None:
            frame = coro.cr_frame
            inner = f"{frame.f_code.co_qualname}:{frame.f_lineno}"
            if any(part in frame.f_code.co_filename for part in PRODUCT):
                product = inner  # the deepest frame of quiverd's own code
                outer = outer or frame.f_code.co_qualname  # the task's actor
            elif "/tests/" in frame.f_code.co_filename:
                harness = inner
            coro = getattr(coro, "cr_await", None)
        if product and not product.startswith(outer + ":"):
            return f"{outer} > {product}"
        return product or harness or inner or "task"
    return getattr(callback, "__qualname__", type(callback).__name__)


@contextmanager
def simulated(seed: int, loop: SimLoop) -> Iterator[None]:
    """The patches of the module doc, undone on exit."""
    rng = random.Random(f"ids-{seed}")
    saved_random = random.getstate()
    random.seed(f"jitter-{seed}")
    saved = (time.time, time.time_ns, time.monotonic, uuid.uuid4, ulid.default_generator,
             anyio.to_thread.run_sync)

    def generated_uuid4() -> uuid.UUID:
        return uuid.UUID(int=rng.getrandbits(128), version=4)

    async def inline(func: Callable[..., Any], *args: Any, abandon_on_cancel: bool = False,
                     cancellable: bool | None = None, limiter: Any = None) -> Any:
        await anyio.lowlevel.checkpoint()
        result = func(*args)
        await anyio.lowlevel.checkpoint()
        return result

    time.time = lambda: loop.wall_ns() / NS
    time.time_ns = loop.wall_ns
    time.monotonic = loop.time
    uuid.uuid4 = generated_uuid4
    ulid.default_generator = ulid.ULIDGenerator(
        clock=lambda: loop.wall_ns() // 1_000_000,
        randomness=lambda _ts: rng.getrandbits(80).to_bytes(10, "big"))
    anyio.to_thread.run_sync = inline  # type: ignore[assignment]
    try:
        yield
    finally:
        (time.time, time.time_ns, time.monotonic, uuid.uuid4, ulid.default_generator,
         anyio.to_thread.run_sync) = saved
        random.setstate(saved_random)


def close_loop(loop: SimLoop) -> None:
    """Cancel what a failed run left and let it unwind (checks off), then close."""
    loop.on_step = None
    try:
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    except Exception:  # noqa: BLE001, S110 - best effort after a failed run
        pass
    loop.close()


class Traced:
    """A run's trace (virtual time, step label): its digest (same seed, same digest) and
    its last steps for a failure's message."""

    trace: list[tuple[float, str]]

    def digest(self) -> str:
        h = hashlib.sha256()
        for t, label in self.trace:
            h.update(f"{t:.6f} {label}\n".encode())
        return h.hexdigest()[:16]

    def tail(self, n: int = 40) -> str:
        return "\n".join(f"  t={t:10.4f}  {label}" for t, label in self.trace[-n:])
