"""Which of a shard's segments still need their whole-file CRC, and the bad ones found
and not yet quarantined: shared by the dispatcher (``open_reader``, in its read thread)
and the scrubber (everything else, on the event loop).

    dispatcher._reader ──open_reader──▶ SegmentChecks ◀──prune, take_found, bind── scrubber
                                           └─ report(): changes.notify (any thread)

Shared state behind one lock, no actor's code, so both actors import it and neither
imports the other (tests/test_layers.py).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from quiverd.kernel.changes import Changes
from quiverd.kernel.errors import CorruptRecord
from quiverd.segments.reader import SegmentReader

HISTORY = 100  # quarantined segments kept for `status`


class SegmentChecks:
    """Which of a shard's segments still need their whole-file CRC, and the bad ones
    found and not yet quarantined. Shared by the dispatcher (``open_reader``, in its
    read thread) and the scrubber (everything else, on the event loop)."""

    def __init__(self, unverified: Iterable[int] = ()) -> None:
        self._lock = threading.Lock()
        self._unverified = set(unverified)
        self._found: dict[int, tuple[str, str]] = {}  # segment_seq -> (error, found_by)
        self.changes = Changes()  # a bad segment was found
        self._token: Any = None
        self._loop_thread: int | None = None
        # For status: the scrubber's progress and what was quarantined at run time.
        self.pass_bytes = 0
        self.pass_done_bytes = 0
        self.quarantined: deque[dict[str, Any]] = deque(maxlen=HISTORY)

    def bind(self) -> None:
        """Called on the event loop by the scrubber: where reports from threads go."""
        self._token = anyio.lowlevel.current_token()
        self._loop_thread = threading.get_ident()

    def open_reader(self, segment_seq: int, path: Path) -> SegmentReader:
        """A reader for delivery (blocking: a worker thread). The first open of a segment
        recovery did not check in full reads every byte; a bad one raises CorruptRecord
        and is reported for quarantine."""
        full = self.is_unverified(segment_seq)
        try:
            reader = SegmentReader.open(path, full=full)
        except CorruptRecord as exc:
            self.report(segment_seq, str(exc), "read")
            raise
        if full:
            self.mark_verified(segment_seq)
        return reader

    def is_unverified(self, segment_seq: int) -> bool:
        with self._lock:
            return segment_seq in self._unverified

    def mark_verified(self, segment_seq: int) -> None:
        with self._lock:
            self._unverified.discard(segment_seq)

    @property
    def unverified_count(self) -> int:
        with self._lock:
            return len(self._unverified)

    def prune(self, live: Iterable[int]) -> None:
        """Forget segments that left the table (the set only ever shrinks)."""
        keep = set(live)
        with self._lock:
            self._unverified &= keep

    def report(self, segment_seq: int, error: str, found_by: str) -> None:
        """A segment failed its check (any thread): the scrubber quarantines it."""
        with self._lock:
            if segment_seq in self._found:
                return
            self._found[segment_seq] = (error, found_by)
        if self._token is None or threading.get_ident() == self._loop_thread:
            self.changes.notify()
        else:
            anyio.from_thread.run_sync(self.changes.notify, token=self._token)

    def take_found(self) -> dict[int, tuple[str, str]]:
        with self._lock:
            found, self._found = self._found, {}
        return found

    def is_found(self, segment_seq: int) -> bool:
        with self._lock:
            return segment_seq in self._found
