"""A Spark task's keepalives while it waits for input (SPEC §7, ``runtime.leases``).

A task attempt holds one connection for its whole ``write()``: the connection is what
keeps its job's writer lease, so the job is never expired while the task lives. Between
batches the task waits for Spark (an expensive upstream stage, a slow shuffle read);
with nothing in flight, the daemon's ``ingest.idle_timeout_ms`` would close the
connection and the lease would run out. So while the task's thread is inside Spark's
iterator, a helper thread sends a JOB ``keepalive`` on the same connection every
``keepalive_ms`` (the daemon's answer to the first one, sent before any row).

    task thread     holds ``lock`` except inside ``next(spark_iterator)``
    helper thread   wakes every interval; takes ``lock`` only if free (the task is
                    waiting for Spark, the socket is idle); sends one keepalive; gives
                    it back. The client is never used by two threads at once.

A keepalive that finds the job aborted (``quiverd jobs abort``) or expired ends the
task's writing at its next batch (``JobConflict``: the attempt gets no end marker).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import TypeVar

from quiverd.client import Client
from quiverd.kernel.errors import JobConflict

T = TypeVar("T")
_END = object()
DECIDED_AGAINST = ("aborted", "expired")


class KeepAlive:
    def __init__(self, client: Client, job_id: str) -> None:
        self.client, self.job_id = client, job_id
        reply = client.keepalive(job_id)  # holds the lease before the first row
        self.interval_s = reply.keepalive_ms / 1000
        self.state = reply.state
        self.lock = threading.Lock()
        self.lock.acquire()  # the task's thread owns the connection unless waiting
        self.idle_since = time.monotonic()
        self.stopping = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, name=f"quiver-keepalive-{job_id}",
                                       daemon=True)

    def __enter__(self) -> KeepAlive:
        self._check()
        self.thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stopping.set()
        self.lock.release()
        self.thread.join()

    def batches(self, source: Iterable[T]) -> Iterator[T]:
        """``source`` with the connection lent to the keepalive thread while it waits."""
        it = iter(source)
        while True:
            self.idle_since = time.monotonic()
            self.lock.release()
            try:
                item = next(it, _END)
            finally:
                self.lock.acquire()
            self._check()
            if item is _END:
                return
            yield item  # type: ignore[misc]

    def _check(self) -> None:
        if self.state in DECIDED_AGAINST:
            raise JobConflict(f"job {self.job_id!r} was {self.state} while this task wrote "
                              "it (an operator's `quiverd jobs abort`, or its writers were "
                              "gone for staging.writer_timeout_s)",
                              hint="rerun the write under a new job id")

    def _run(self) -> None:
        while not self.stopping.wait(self.interval_s / 2):
            if not self.lock.acquire(blocking=False):
                continue  # the task is using the connection: it is alive
            try:
                if self.stopping.is_set():
                    return
                if time.monotonic() - self.idle_since >= self.interval_s:
                    reply = self.client.keepalive(self.job_id)
                    self.state, self.sent = reply.state, self.sent + 1
                    self.idle_since = time.monotonic()
            except Exception:  # noqa: BLE001 - the task's next send reports a broken link
                return
            finally:
                self.lock.release()
