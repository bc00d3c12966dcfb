"""Receive buffers for BUNDLE frames, reused once the bundle is acknowledged.

A frame buffer is written once by ``recv_into`` and read by validation and the WAL
write. After the ACK (the covering fdatasync returned) nothing reads it again: the
open segment keeps only the slots' schemas and batch counts and the finalizer reads
the bytes back from the WAL. Reusing the buffer then spares the kernel zeroing fresh
pages for every bundle (≈ 3.7 µs per 4 KiB on these machines, NOTES.md), which was
most of the daemon's system time at 1 MiB bundles.

    take(n)   a writable memoryview of n bytes, over a pooled buffer when one of
              a fitting size is free (capacity n .. 2n), else a new one
              (capacity rounded up to GRAIN)
    give(b)   the buffer behind a view from ``take`` is free again

Bounded: idle buffers are kept only while they and the bytes in flight (``busy()``,
the pending-bytes budget held) stay within ``max_bytes``, so receive buffers, idle or
not, never exceed ``ingest.max_pending_bytes``, and idle ones ``max_idle_bytes`` (a past
burst does not pin its peak); the rest go back to the allocator.
Frames below ``MIN_POOLED_BYTES`` are not pooled (the allocator's small size classes
are warm anyway). Event-loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

GRAIN = 64 * 1024
MIN_POOLED_BYTES = 64 * 1024


class BufferPool:
    def __init__(self, max_bytes: int, busy: Callable[[], int] = lambda: 0,
                 max_idle_bytes: int | None = None) -> None:
        self.max_bytes, self.busy = max_bytes, busy
        self.max_idle_bytes = max_bytes if max_idle_bytes is None else max_idle_bytes
        self._free: list[pa.Buffer] = []
        self._idle_bytes = 0
        self.reused = 0
        self.allocated = 0

    def take(self, nbytes: int) -> tuple[memoryview, pa.Buffer | None]:
        """A view of ``nbytes`` writable bytes and the pooled buffer behind it (None
        when the size is not pooled: nothing to give back)."""
        if nbytes < MIN_POOLED_BYTES:
            return memoryview(pa.allocate_buffer(nbytes)).cast("B"), None
        buf = self._fitting(nbytes)
        if buf is None:
            self.allocated += 1
            buf = pa.allocate_buffer(-(-nbytes // GRAIN) * GRAIN)
        else:
            self.reused += 1
        return memoryview(buf).cast("B")[:nbytes], buf

    def give(self, buf: pa.Buffer | None) -> None:
        """``buf`` is no longer read by anyone: keep it for the next frame if room."""
        if buf is None or self._idle_bytes + buf.size > self.max_idle_bytes \
                or self._idle_bytes + buf.size + self.busy() > self.max_bytes:
            return
        self._free.append(buf)
        self._idle_bytes += buf.size

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def _fitting(self, nbytes: int) -> pa.Buffer | None:
        # Most recently freed first: its pages are the warmest.
        for i in range(len(self._free) - 1, -1, -1):
            buf = self._free[i]
            if nbytes <= buf.size <= 2 * nbytes + GRAIN:
                del self._free[i]
                self._idle_bytes -= buf.size
                return buf
        return None
