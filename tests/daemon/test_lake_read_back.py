"""Read back never, in a running daemon (issue 30): the Iceberg worker registers the
uploader's files from the footers the uploader handed it, without one request for a
data object (the S3 fault proxy records every request), and the DataFiles it made and
the zone maps the indexer recorded equal what reading the objects back gives."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from pyiceberg.exceptions import NoSuchTableError

from quiverd.kernel.config import load
from quiverd.kernel.logs import get as get_logger
from quiverd.lake.iceberg import DataFileRef, table_name
from quiverd.lake.iceberg.files import read_footer, to_data_file
from quiverd.lake.model import FileRow, ZoneMap
from quiverd.lake.parquet import zone_maps
from quiverd.lake.tier import open_tier
from tests.daemon.iceberg_helpers import load as load_table
from tests.daemon.lake_helpers import FAST_LAKE, registered_rows, send_logs, wait_for_lake
from tests.daemon.test_lake_pg_s3 import _s3_settings
from tests.services.faultproxy import FaultProxy

pytestmark = pytest.mark.timeout(180)


class RecordingProxy(FaultProxy):
    """The fault proxy (every request line recorded), minus ``Expect: 100-continue``: the
    proxy reads a request whole before forwarding, and relayed the upstream's interim
    100 as the answer (the Iceberg worker's S3 client sends the header; OpenDAL not)."""

    def _forward(self, raw: bytes, *, head_request: bool) -> tuple[bytes, bool]:
        head, sep, body = raw.partition(b"\r\n\r\n")
        kept = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"expect:")]
        return super()._forward(b"\r\n".join(kept) + sep + body, head_request=head_request)


@pytest.fixture
def recorded_s3(s3_server: Any, s3_bucket: dict[str, str]) -> Iterator[tuple[FaultProxy,
                                                                               dict[str, str]]]:
    proxy = RecordingProxy((s3_server.host, s3_server.port))
    try:
        yield proxy, {**s3_bucket, "endpoint": proxy.url}
    finally:
        proxy.stop()
DATA_FIELDS = ("record_count", "file_size_in_bytes", "column_sizes", "value_counts",
               "null_value_counts", "nan_value_counts", "lower_bounds", "upper_bounds",
               "split_offsets")


def test_iceberg_worker_reads_no_data_object_when_the_uploader_hands_it_the_footers(
        daemon_factory: Any, recorded_s3: tuple[FaultProxy, dict[str, str]],
        s3_bucket: dict[str, str]) -> None:
    proxy, options = recorded_s3
    settings = {**FAST_LAKE, **_s3_settings(options), "lake.iceberg.enabled": True,
                "lake.iceberg.linger_ms": 50, "lake.iceberg.reconcile_interval_s": 0.5,
                # Keep the local copies: the zone maps are compared with a read-back.
                "lake.delete_after_upload": False, "lake.local_retention_s": 3600,
                "lake.scrub.rate_mb_per_s": 0}  # the scrubber reads objects: not now
    d = daemon_factory(settings, in_process=True).start()
    sent = send_logs(d, clients=2, batches=6)
    wait_for_lake(d, sent)
    rows = registered_rows(d)
    by_location = _projected(d, rows, s3_bucket)
    # What touched the data objects (their keys hold the file ids, the rest of a key may
    # be percent-encoded): the uploads only, a PUT and the uploader's two HEADs (is the
    # key free, then verify) each. Reading the footers back cost the worker one GET and
    # two HEADs per file (measured before: 4 files, GET 4, HEAD 16, PUT 4).
    requests = list(proxy.requests)
    touched = Counter(line.split()[0] for line in requests
                      if any(r.file_id in line for r in rows))
    assert touched.keys() <= {"PUT", "HEAD"} and touched["PUT"] >= len(rows), (touched,
                                                                              requests[:20])
    assert touched["HEAD"] <= 2 * len(rows), touched

    # The DataFiles in the tables, against the ones a read-back of each object makes.
    for location, (tbl, data_file) in by_location.items():
        row = next(r for r in rows if location.endswith(r.object_key))
        ref = DataFileRef(file_id=row.file_id, location=location, client=row.client_name,
                          slot=row.slot, partition_column="_quiver_ingested_at")
        back = to_data_file(read_footer(tbl.io, ref), tbl.metadata, data_file.partition[0])
        assert ({f: getattr(data_file, f) for f in DATA_FIELDS}
                == {f: getattr(back, f) for f in DATA_FIELDS})

    # The zone maps the indexer recorded from the handed footers, against the local copy.
    indexed = anyio.run(_zone_maps, Path(d.config_path), [r.file_id for r in rows])
    for row in rows:
        if row.local_path and Path(row.local_path).exists() and row.file_id in indexed:
            columns = [z.column for z in indexed[row.file_id]]
            assert indexed[row.file_id] == zone_maps(Path(row.local_path), columns)
    assert indexed
    # ... from the footers the uploader handed over, not from the local copies.
    events = d.events("lake_file_indexed")
    assert {e["file_id"] for e in events} == set(indexed)
    assert {e["footer"] for e in events} == {"writer"}
    assert d.stop() == 0


def _projected(d: Any, rows: list[FileRow], s3: dict[str, str], timeout_s: float = 90
               ) -> dict[str, tuple[Any, Any]]:
    """location -> (table, DataFile) once every registered file is in its table."""
    deadline = time.monotonic() + timeout_s
    while True:
        found: dict[str, tuple[Any, Any]] = {}
        for client, slot in {(r.client_name, r.slot) for r in rows}:
            try:
                tbl = load_table(d, table_name(client, slot), s3=s3)
            except NoSuchTableError:
                continue
            found.update((t.file.file_path, (tbl, t.file)) for t in tbl.scan().plan_files())
        if len(found) == len(rows):
            return found
        assert time.monotonic() < deadline, (len(found), len(rows), d.status()["lake"])
        time.sleep(0.5)


async def _zone_maps(config_path: Path, file_ids: list[str]) -> dict[str, list[ZoneMap]]:
    async with open_tier(load(config_path), get_logger("test")) as tier:
        return await tier.catalog.zone_maps(file_ids)
