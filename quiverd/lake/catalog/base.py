"""The lake catalog: which lake files exist, what they hold, and which are live.

One interface, two backends: PostgreSQL (``catalog.dsn`` set; several daemons and readers
share it) and SQLite in <data_dir>/catalog.sqlite (one daemon). Both hold the same tables;
all times are BIGINT nanoseconds since the Unix epoch (UTC):

    files        one row per lake file: every FileRow field, a column of the same name
      file_id PK │ client_name │ uri │ start_ts │ end_ts │ row_count │ … │ state │ …
      indexes: (client_name, start_ts), (source_id, shard), (state)
      `indexes` (the file's index kinds) is JSON text in SQLite, jsonb in PostgreSQL
    coverage     the bundles a file holds, one row per (file, segment)
      file_id ─▶ files │ source_id │ shard │ slot │ segment_seq │ bundle_indexes ("0-2,5,7-8")
      PK (file_id, segment_seq); index (source_id, shard, segment_seq)
    zone_maps    per-file, per-column min/max/null count; min/max are JSON scalars as text
      file_id ─▶ files │ column_name │ min_value │ max_value │ null_count
      PK (file_id, column_name)
    schema_version   one row per applied migration step: version PK │ applied_at
    quiver_jobs  one row per decided Spark write job (SPEC §7), see ``jobs``
      job_id PK │ state │ winners (JSON text / jsonb) │ decided_at_ns │ decided_by │ reason

Exactly once into the lake: a bundle (source_id, shard, slot, segment_seq, bundle_index)
is held by at most one file in a REGISTERED state. ``register`` refuses a file whose
coverage meets another registered file's (``DuplicateCoverage``), atomically with the
row's insert, so a redelivered bundle is never registered twice. ``covered`` is what the
uploader asks before uploading a redelivered bundle.

Exactly one decision per job: ``decide_job`` records a job's commit, abort or expiry only
if it has none yet, and every caller gets back the decision that stands.

Errors: ``CatalogUnavailable`` (retryable) when the database cannot be reached or fails a
statement for reasons of its own (down, disk full, I/O error, lock timeout); the caller
retries the same call, which every method allows (they are idempotent). Wrong arguments
raise ValueError/KeyError/TypeError as usual; ``DuplicateCoverage``, ``ReplaceConflict``
and ``StateConflict`` are answers, not outages: retrying cannot change them.
"""

from __future__ import annotations

import abc
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Sequence,
)
from types import TracebackType
from typing import Any

import anyio

from quiverd.kernel.errors import LakeError
from quiverd.kernel.jobs import JobDecision
from quiverd.kernel.logs import Logger
from quiverd.lake.model import (
    Coverage,
    FileRow,
    FileState,
    ZoneMap,
)

NOTIFY_CHANNEL = "quiver_files"
JOBS_CHANNEL = "quiver_jobs"  # job ids, as decisions are recorded
NOTIFY_BUFFER = 1024  # ids a slow listener may lag behind before the oldest are dropped


class DuplicateCoverage(LakeError):
    """Bundles of ``file_id`` are already held by other registered files: nothing changed."""

    hint = ("the bundles are in the lake already: drop the file instead of registering it "
            "(the uploader asks `covered` before uploading a redelivered bundle)")

    def __init__(self, file_id: str, other_file_ids: Sequence[str]) -> None:
        self.file_id = file_id
        self.other_file_ids = tuple(other_file_ids)
        super().__init__(f"{file_id} covers bundles already held by {', '.join(other_file_ids)}")


class ReplaceConflict(LakeError):
    """A compaction's inputs are no longer all registered (another compaction won)."""

    hint = "discard the compacted output; re-plan from the live files"


class StateConflict(LakeError):
    """The row is not in a state that allows the change (e.g. registering an Abandoned file)."""


class Notifications(AsyncIterator[str]):
    """Ids since the subscription: file ids registered (by ``register`` or ``replace``)
    from ``notifications()``, job ids decided (by ``decide_job``) from ``job_notifications()``.

    Three ways to use it, all subscribing before the first id is awaited:
    ``async for file_id in catalog.notifications():``, ``feed = await
    catalog.notifications()`` and ``async with catalog.notifications() as feed:``. The
    in-process feed starts when ``notifications()`` returns; PostgreSQL's LISTEN
    connection is opened (if not open yet) by the ``await``/``async with``/first
    iteration: await it when ids of other processes committed right after must be seen.

    Bounded: if the reader falls ``NOTIFY_BUFFER`` ids behind, the oldest are dropped and
    ``dropped`` counts them; a reader that sees ``dropped`` grow catches up through
    ``list_files`` (``job_decisions``). Iteration ends when the catalog closes (ids still
    queued are dropped), and raises ``CatalogUnavailable`` when the feed is lost
    (PostgreSQL's LISTEN connection): subscribe again after a backoff and catch up through
    ``list_files`` (``job_decisions``). Leaving early: ``aclose()`` (or the ``async with``).
    """

    def __init__(self, hub: NotificationHub,
                 ensure: Callable[[], Awaitable[None]] | None) -> None:
        self._hub = hub
        self._ensure = ensure  # connects the backend's feed (PostgreSQL's LISTEN)
        self._send, self._receive = anyio.create_memory_object_stream[str](NOTIFY_BUFFER)
        self._error: Exception | None = None
        self.dropped = 0

    def __aiter__(self) -> Notifications:
        return self

    async def __anext__(self) -> str:
        await self._connect()
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            if self._error is not None:
                raise self._error from None
            raise StopAsyncIteration from None

    def __await__(self) -> Generator[Any, None, Notifications]:
        return self._connect().__await__()

    async def __aenter__(self) -> Notifications:
        return await self._connect()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._hub.unsubscribe(self)
        self._end(None)

    async def _connect(self) -> Notifications:
        if self._ensure is not None and self._error is None:
            try:
                await self._ensure()
            except Exception as exc:
                self._hub.unsubscribe(self)
                self._end(exc)
                raise
            self._ensure = None  # only once it worked: a cancelled connect is tried again
        return self

    def _offer(self, file_id: str) -> bool:
        """Queue ``file_id``, dropping the oldest when full; False if one was dropped."""
        try:
            self._send.send_nowait(file_id)
            return True
        except anyio.WouldBlock:
            self._receive.receive_nowait()
            self.dropped += 1
            self._send.send_nowait(file_id)
            return False
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return True

    def _end(self, error: Exception | None) -> None:
        # Both ends close here, so an iterator nobody drains leaves no open stream behind.
        if self._error is None:
            self._error = error
        self._send.close()
        self._receive.close()


class NotificationHub:
    """Fans the ids of one channel out to every open ``Notifications``; runs on the event
    loop only."""

    def __init__(self, *, backend: str, log: Logger, channel: str = NOTIFY_CHANNEL) -> None:
        self._backend = backend
        self._log = log
        self._channel = channel
        self._subscribers: set[Notifications] = set()
        self.closed = False  # the catalog's own "closed for good" flag

    def subscribe(self, ensure: Callable[[], Awaitable[None]] | None = None) -> Notifications:
        """A new feed; after ``close`` it is one that has already ended."""
        feed = Notifications(self, None if self.closed else ensure)
        if self.closed:
            feed._end(None)
        else:
            self._subscribers.add(feed)
        return feed

    def unsubscribe(self, feed: Notifications) -> None:
        self._subscribers.discard(feed)

    def publish(self, file_ids: Iterable[str]) -> None:
        for file_id in file_ids:
            for feed in self._subscribers:
                if not feed._offer(file_id) and feed.dropped == 1:
                    self._log.warning("catalog_notifications_dropped", backend=self._backend,
                                      channel=self._channel, buffer=NOTIFY_BUFFER)

    def fail(self, error: Exception) -> None:
        """End every current subscriber with ``error``; later subscriptions still work."""
        subscribers, self._subscribers = self._subscribers, set()
        for feed in subscribers:
            feed._end(error)

    def close(self) -> None:
        self.closed = True
        subscribers, self._subscribers = self._subscribers, set()
        for feed in subscribers:
            feed._end(None)


class Catalog(abc.ABC):
    """The catalog's operations; every method is safe to retry after CatalogUnavailable."""

    backend: str  # "sqlite" or "postgresql"

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect and apply pending migrations (idempotent)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections and end every ``notifications`` iterator (idempotent).

        Final: later ``notifications()`` feeds end at once, other calls raise RuntimeError.
        """

    @abc.abstractmethod
    async def insert_file(self, row: FileRow) -> None:
        """Insert a new row (usually Received); nothing happens if ``file_id`` exists."""

    @abc.abstractmethod
    async def set_state(self, file_id: str, state: FileState, /, **fields: Any) -> None:
        """Move a row to ``state`` and set the named FileRow ``fields``; updated_at = now.

        Any state to any state: the lifecycle is the caller's. KeyError if the row does
        not exist; ValueError for a field that is not settable (unknown, file_id, state,
        updated_at) or a value of the wrong type.
        """

    @abc.abstractmethod
    async def set_state_if(self, file_id: str, state: FileState,
                           only_from: Iterable[FileState], /, **fields: Any) -> bool:
        """``set_state`` only while the row is in one of ``only_from`` (one statement);
        False, changing nothing, when it is not (or the row is gone). For changes that
        race with another writer, e.g. evicting a file compaction may have replaced."""

    @abc.abstractmethod
    async def register(self, row: FileRow, coverage: list[Coverage]) -> bool:
        """Make the file live: upsert ``row`` as MetaRegistered with its ``coverage``.

        One transaction; True if this call registered it, False if it already was
        (registered or compacted: nothing changes). DuplicateCoverage if another
        registered file holds any of these bundles; StateConflict if the row is Abandoned.
        """

    @abc.abstractmethod
    async def covered(self, source_id: str, shard: int, segment_seq: int) -> dict[int, set[int]]:
        """slot -> bundle indexes of that segment held by files in REGISTERED states."""

    @abc.abstractmethod
    async def covered_parts(self, source_id: str, shard: int, segment_seq: int
                            ) -> dict[tuple[int, str], set[int]]:
        """(slot, hour partition) -> bundle indexes of that segment held by files in
        REGISTERED states. The partition is the file key's ``date=../hour=..`` (a slot of
        a bundle spanning hours is held by one file per hour); "" for a key of the
        layout before hours, whose file holds the whole slot (``lake.partitions``)."""

    @abc.abstractmethod
    async def get(self, file_id: str) -> FileRow | None:
        """The row, or None."""

    @abc.abstractmethod
    async def list_files(self, *, client: str | None = None, since_ns: int | None = None,
                         until_ns: int | None = None, states: Iterable[FileState] | None = None,
                         node_id: str | None = None, source_id: str | None = None,
                         slot: int | None = None, limit: int | None = None,
                         newest_first: bool = False) -> list[FileRow]:
        """Rows matching every given filter, ordered by (start_ts, file_id), or the
        other way round with ``newest_first`` (``limit=1``: the latest file).

        ``since_ns``/``until_ns`` select files whose [start_ts, end_ts] overlaps
        [since_ns, until_ns).
        """

    @abc.abstractmethod
    async def record_index(self, file_id: str, zone_maps: list[ZoneMap],
                           indexes: list[str]) -> None:
        """Replace the file's zone maps, set ``indexes``; MetaRegistered/Indexed -> Indexed.

        An Evicted file stays Evicted; any other state raises StateConflict.
        """

    @abc.abstractmethod
    async def zone_maps(self, file_ids: list[str]) -> dict[str, list[ZoneMap]]:
        """Zone maps by file id (columns in name order); files without maps are absent."""

    @abc.abstractmethod
    async def replace(self, old_ids: list[str], new_row: FileRow) -> None:
        """Compaction, one transaction: ``new_row`` becomes MetaRegistered and takes every
        coverage row of ``old_ids``, which become Compacted into it.

        ReplaceConflict (nothing changed) if an old row is not registered. Retrying a
        replace that already committed is a no-op.
        """

    @abc.abstractmethod
    async def restore(self, file_id: str) -> bool:
        """A quarantined (or lost) file is live again: Quarantined/Lost -> Evicted (its
        object authoritative, no local copy, zone maps as they were), in one transaction
        with register's check, so DuplicateCoverage (nothing changed) if another
        registered file took any of its bundles meanwhile. Notifies like ``register``.

        The caller has checked the object against the row's size and CRC-32C first
        (``quiverd files restore``). True if this call restored it, False if the file
        already is registered (a retry); KeyError if unknown; StateConflict otherwise.
        """

    async def forget(self, file_id: str) -> bool:
        """A quarantined file is given up for lost: Quarantined -> Lost. Its rows are gone
        from the lake, and that is now known: readers no longer fail on it and fsck lists
        it as known. True if this call moved it, False if it already was Lost (a retry);
        KeyError if unknown; StateConflict from any other state."""
        if await self.set_state_if(file_id, FileState.LOST, (FileState.QUARANTINED,)):
            return True
        row = await self.get(file_id)
        if row is None:
            raise KeyError(file_id)
        if row.state is FileState.LOST:
            return False
        raise StateConflict(f"{file_id} is {row.state.value}: only a quarantined file can be "
                            "forgotten", hint="`quiverd files show FILE_ID` shows its state")

    @abc.abstractmethod
    async def delete_rows(self, file_ids: list[str]) -> None:
        """Drop the rows (with coverage and zone maps) of Abandoned/Compacted files.

        Ids in other states, or unknown, are left alone.
        """

    @abc.abstractmethod
    def notifications(self) -> Notifications:
        """A feed of the file ids registered from now on (see Notifications)."""

    @abc.abstractmethod
    async def decide_job(self, decision: JobDecision) -> tuple[JobDecision, bool]:
        """Record ``decision`` unless the job already has one. Returns (the decision that
        stands, True if it was this call that recorded it).

        Atomic: two daemons deciding the same job at once (one commit, one expiry) end
        with exactly one decision, and both callers get that same one back. A
        ``decided_at_ns`` of 0 is recorded as now. A new decision also notifies job
        listeners (PostgreSQL: NOTIFY ``quiver_jobs``, job_id as payload, in the same
        transaction). A retry after CatalogUnavailable whose first try did commit gets
        (that decision, False). ValueError for a bad job id, winners on a decision that is
        not a commit, or a partition with two winners.
        """

    @abc.abstractmethod
    async def job_decisions(self, job_ids: Iterable[str]) -> dict[str, JobDecision]:
        """The recorded decisions of those jobs that have one (unknown ids are absent)."""

    @abc.abstractmethod
    def job_notifications(self) -> Notifications:
        """A feed of the job ids decided from now on (see Notifications).

        PostgreSQL: LISTEN ``quiver_jobs``, so any daemon's decisions on the database.
        SQLite: only decisions made through this catalog object; callers poll
        ``job_decisions`` for other processes' decisions.
        """

    @abc.abstractmethod
    async def prune_job_decisions(self, decided_before_ns: int) -> int:
        """Delete decisions with decided_at_ns < ``decided_before_ns``; how many went.

        A pruned job has no decision any more: prune only what no daemon can still be
        deciding (older than the staged-row TTL), or a late decision would stand anew.
        """

    @abc.abstractmethod
    async def renew_job_leases(self, node_id: str, job_ids: list[str], now_ns: int) -> None:
        """Record that ``node_id`` has a live writer of each of ``job_ids`` at ``now_ns``
        (``runtime.leases``), and delete lease rows not renewed for a day."""

    @abc.abstractmethod
    async def job_leases(self, job_ids: list[str], *, exclude_node: str) -> dict[str, int]:
        """job_id -> the newest lease renewal (ns) of that job by any node but
        ``exclude_node``; jobs no other node leases are absent."""

    async def __aenter__(self) -> Catalog:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()
