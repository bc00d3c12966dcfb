"""``lake.schema_mode = "strict"``: each (client, slot) keeps the schema it established,
and a bundle whose schema conflicts with it is refused at ingest (SCHEMA_CONFLICT).

The established schema of a (client, slot) is ``drift.unify`` over every schema
accepted for it in strict mode: compatible drift (a new optional column, int32 then
int64, a dictionary growing its indices, ...) widens it; a column whose type cannot be
unified with it (string then int) refuses the bundle before it is handed to a shard:
never acked, nothing stored. In "evolve" mode (the default) nothing here runs: the
uploader starts a new lake file instead.

Cost: the connection asks ``accepts`` for every bundle, a set lookup per slot of
``(client, slot, fingerprint)``. Only a fingerprint not seen yet takes the slow path
(``check``): the record is loaded (first sight of the (client, slot) since the start),
unified, and, when the established schema widens, written back before the bundle goes
on. Every schema accepted is covered by the established one, so a fingerprint once
accepted stays accepted; a refused one is remembered too (its refusal text), since a
wider established schema can never take a column it already refused.

Record: one file per (client, slot) (``quiverd.lake.schema_record``: its layout), written
crash-safely from a worker thread before the bundle that widened it goes on.

Why a record of its own rather than the lake: the catalog knows uploaded files only,
the WAL and segments hold what is not uploaded yet and are deleted after upload,
and retention may delete every file of a client: none of them holds the schema for as
long as the contract lasts. The record is durable before the first bundle that widened
it is handed to the WAL, so every bundle acked in strict mode is covered, uploaded or
not, across restarts; a restart reads one small file per (client, slot) on its first
bundle and scans nothing. A (client, slot) with no record (new, or written before
strict mode was turned on) is established by its first bundle in strict mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import anyio
import pyarrow as pa

from quiverd.kernel.bundle import Slot
from quiverd.kernel.errors import CorruptRecord, ProtocolError
from quiverd.kernel.logs import Logger
from quiverd.lake.drift import conflict, unify
from quiverd.lake.schema_record import SCHEMAS_DIR, read_record, record_path, write_record
from quiverd.protocol.frames import ErrorCode

__all__ = ["SCHEMAS_DIR", "EstablishedSchemas"]

CAPACITY = 4096  # (client, slot) schemas and fingerprint verdicts held in memory each

K = TypeVar("K")
V = TypeVar("V")
Key = tuple[str, int]  # (client, slot)
Verdict = tuple[str, int, bytes]  # (client, slot, fingerprint)


class EstablishedSchemas:
    """The strict-mode check, shared by every ingest connection of the daemon."""

    def __init__(self, data_dir: Path, *, log: Logger, capacity: int = CAPACITY) -> None:
        self.data_dir = Path(data_dir)
        self.log, self.capacity = log, capacity
        self.schemas: dict[Key, pa.Schema | None] = {}  # None: no record yet
        self.accepted: set[Verdict] = set()
        self.refused: dict[Verdict, str] = {}
        self.lock = anyio.Lock()  # one slow path at a time: two widenings never race

    def accepts(self, client: str, slots: Sequence[Slot]) -> bool:
        """The hot path: every slot's schema was accepted for its (client, slot) before."""
        accepted = self.accepted
        return all((client, s.slot, s.fingerprint) in accepted for s in slots)

    async def check(self, client: str, slots: Sequence[Slot]) -> str:
        """Why the bundle is refused ("" when it is not); records the widened schemas
        (durably) before returning "" for a bundle that widened one."""
        async with self.lock:
            widened: dict[Key, pa.Schema] = {}
            for s in slots:
                verdict = (client, s.slot, s.fingerprint)
                if verdict in self.accepted:
                    continue
                if verdict in self.refused:
                    return self.refused[verdict]
                assert s.schema is not None, "validated slots carry their schema"
                key = (client, s.slot)
                current = widened[key] if key in widened else await self._load(key)
                try:
                    merged = unify(current, s.schema)
                    problem = ""
                except ValueError as exc:  # a column named twice: no lake file takes it
                    merged, problem = None, f"client {client!r} slot {s.slot}: {exc}"
                if merged is None:
                    assert current is not None or problem, "unify(None, s) succeeds or raises"
                    why = problem or _refusal(client, s.slot, current, s.schema)
                    _bounded_put(self.refused, verdict, why, self.capacity)
                    self.log.warning("schema_conflict_refused", client=client, slot=s.slot,
                                     error=why)
                    return why
                if current is None or not merged.equals(current):
                    widened[key] = merged
            for key, schema in widened.items():
                await anyio.to_thread.run_sync(write_record, self.path(key), key, schema)
                _bounded_put(self.schemas, key, schema, self.capacity)
                self.log.info("schema_established", client=key[0], slot=key[1],
                              columns=len(schema))
            for s in slots:
                if len(self.accepted) >= self.capacity:
                    self.accepted.clear()  # verdicts are recomputed, never wrong
                self.accepted.add((client, s.slot, s.fingerprint))
            return ""

    def path(self, key: Key) -> Path:
        return record_path(self.data_dir, key)

    async def _load(self, key: Key) -> pa.Schema | None:
        if key not in self.schemas:
            try:
                schema = await anyio.to_thread.run_sync(read_record, self.path(key), key)
            except CorruptRecord as exc:
                raise ProtocolError(ErrorCode.INTERNAL, f"{exc}; the daemon refuses this "
                                    "(client, slot)'s bundles until it is fixed (delete it: "
                                    "the next bundle establishes the schema again)") from None
            _bounded_put(self.schemas, key, schema, self.capacity)
        return self.schemas[key]


def _refusal(client: str, slot: int, current: pa.Schema, incoming: pa.Schema) -> str:
    found = conflict(current, incoming)
    what = (f"column {found[0]!r} is {found[2]} in this bundle, {found[1]} in the "
            "established schema" if found else "its schema cannot be unified with the "
            "established one")
    return (f"client {client!r} slot {slot}: {what} (lake.schema_mode = \"strict\"); "
            "nothing of this bundle was stored: send the column as "
            f"{found[1] if found else 'before'}, or write the new shape under another "
            "client or slot")


def _bounded_put(d: dict[K, V], key: K, value: V, capacity: int) -> None:
    """Insert, dropping the oldest entry when full (every entry can be found again)."""
    if key not in d and len(d) >= capacity:
        d.pop(next(iter(d)))
    d[key] = value
