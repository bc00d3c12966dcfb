"""The native fast path: ``spark.read.parquet(*local_paths(...))`` on the fs store."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.spark.paths import local_paths, read_parquet  # noqa: E402 - after the skip
from tests.daemon.lake_helpers import FAST_LAKE, send_logs, wait_for_lake  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_local_paths_read_natively_equal_format_quiver(daemon_factory: Any, spark: Any) -> None:
    d = daemon_factory({**FAST_LAKE}).start()
    sent = send_logs(d, clients=2, batches=4)
    wait_for_lake(d, sent)
    paths = local_paths(str(d.config_path), client="client-0")
    assert paths and all(p.startswith(str(d.data_dir)) and p.endswith(".parquet")
                         for p in paths)
    native = read_parquet(spark, str(d.config_path), client="client-0")
    via = spark.read.format("quiver").option("config", str(d.config_path)) \
        .option("client", "client-0").load()
    cols = ["batch", "i", "msg", "_quiver_ingested_at"]  # timestamps too, in microseconds
    assert native.count() == sent[("client-0", 0)] == via.count()
    assert sorted(map(tuple, native.select(*cols).collect())) == \
        sorted(map(tuple, via.select(*cols).collect()))
    assert local_paths(str(d.config_path), client="nobody") == []
    assert d.stop() == 0


def test_local_paths_refuse_a_store_that_is_not_local(tmp_path: Any) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'data_dir = "{tmp_path}"\n[lake.store]\nscheme = "s3"\n'
                      '[lake.store.options]\nbucket = "b"\nregion = "us-east-1"\n')
    with pytest.raises(ValueError, match='format\\("quiver"\\)'):
        local_paths(str(config), client="c")
