"""Issue 20 item 0: the catalog's uri of a new file is plain (client=web, not
client%3Dweb), and the readers keep reading rows written before, whose fs URIs are
percent-encoded: ``quiverd files list``, the Spark reader (driver query and executor
open, no JVM) and its native fast path (``local_paths``), and ``key_of``."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import anyio
import pyarrow as pa
import pyarrow.parquet as pq

from quiverd.kernel.layout import DataDir
from quiverd.lake.model import FileRow
from quiverd.spark.objects import open_object
from quiverd.spark.paths import local_paths
from quiverd.spark.reader import Lake, Selection
from tests.daemon.lake_helpers import quiverd_cli
from tests.lake.helpers import add_file, open_test_tier


def two_files(root: Path) -> tuple[FileRow, FileRow, str]:
    """Two registered files of client web; the second's uri rewritten as quiverd wrote it
    before issue 20 (Path.as_uri: every '=' encoded). Returns (new, old, old uri)."""
    table = pa.table({"n": pa.array(range(10), pa.int64())})

    async def write() -> tuple[FileRow, FileRow, str]:
        async with open_test_tier(root) as tier:
            new = await add_file(tier, table, client="web", segment=1)
            old = await add_file(tier, table, client="web", segment=2)
            path = tier.store.local_path(old.object_key)
            assert path is not None and tier.store.key_of(new.uri) == new.object_key
            old_uri = path.as_uri()
            assert tier.store.key_of(old_uri) == old.object_key
        return new, old, old_uri

    new, old, old_uri = anyio.run(write)
    with sqlite3.connect(DataDir(root).catalog_db) as db:
        db.execute("UPDATE files SET uri = ? WHERE file_id = ?", (old_uri, old.file_id))
    return new, old, old_uri


def test_store_uris_new_plain_old_encoded_both_read(tmp_path: Path) -> None:
    new, old, old_uri = two_files(tmp_path)
    objects = tmp_path / "objects"
    assert new.uri == f"file://{objects}/{new.object_key}" and "client=web/" in new.uri
    assert "client%3Dweb/" in old_uri
    config = tmp_path / "config.toml"
    config.write_text(f'data_dir = "{tmp_path}"\n')

    done = quiverd_cli("files", "list", "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr
    listed = {r["file_id"]: r for r in json.loads(done.stdout)}
    assert listed[new.file_id]["uri"] == new.uri and listed[old.file_id]["uri"] == old_uri
    assert {r["object"] for r in listed.values()} == {"ok"}

    lake = Lake.open(str(config))
    rows, _ = lake.query(Selection.parse({"config": str(config), "client": "web"}),
                         zone_maps=False)
    assert {r.file_id: r.uri for r in rows} == {new.file_id: new.uri, old.file_id: old_uri}
    for row in rows:
        assert pq.read_table(open_object(lake.partition(row))).num_rows == 10

    paths = local_paths(str(config), client="web")
    assert paths == [str(objects / r.object_key) for r in rows]
    assert all(Path(p).is_file() for p in paths)
