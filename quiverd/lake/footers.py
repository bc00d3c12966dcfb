"""Footers of the lake files this daemon wrote, handed from the uploader to the readers
that would otherwise read them back (issue 30, "read back never").

    uploader: ActiveFile.close ─FileFacts.footer─▶ publisher ─put(file_id)─▶ Footers
                                                                 │ peek / done(reader)
                                    indexer (zone maps) ◀────────┤
                                    projector (Iceberg DataFile) ◀┘  with the file ref,
                                                                     to the worker process

An entry is dropped once every reader named at construction said ``done`` with it, or
when the entries pass ``limit_bytes`` (oldest first). A reader that finds no entry (a
file registered before a restart, a compaction's output, an entry dropped for room)
reads the footer from the file as before: the handoff saves reads, it never decides
what is read. One event loop uses it (no lock).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

LIMIT_BYTES = 32 << 20  # ~1,000 footers of 32 KiB; a logs-like file's is ~4 KiB


class Footers:
    """file id -> serialized footer (``FileFacts.footer``), until its readers took it."""

    def __init__(self, readers: Collection[str], *, limit_bytes: int = LIMIT_BYTES) -> None:
        assert readers, "a handoff with no reader keeps nothing"
        self.readers = frozenset(readers)
        self.limit_bytes = limit_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, tuple[bytes, set[str]]] = OrderedDict()

    def put(self, file_id: str, footer: bytes) -> None:
        if not footer or len(footer) > self.limit_bytes:
            return
        self.forget(file_id)
        self._entries[file_id] = (footer, set(self.readers))
        self.nbytes += len(footer)
        while self.nbytes > self.limit_bytes:
            _, (dropped, _) = self._entries.popitem(last=False)
            self.nbytes -= len(dropped)

    def peek(self, file_id: str) -> bytes:
        """The file's footer, b"" when the handoff does not hold it."""
        entry = self._entries.get(file_id)
        return entry[0] if entry is not None else b""

    def done(self, file_id: str, reader: str) -> None:
        """``reader`` needs the footer no more; the last reader's call drops it."""
        assert reader in self.readers, reader
        entry = self._entries.get(file_id)
        if entry is None:
            return
        entry[1].discard(reader)
        if not entry[1]:
            self.forget(file_id)

    def forget(self, file_id: str) -> None:
        entry = self._entries.pop(file_id, None)
        if entry is not None:
            self.nbytes -= len(entry[0])

    def __len__(self) -> int:
        return len(self._entries)
