"""SQL names for the quiver source in Spark local mode: CREATE TABLE and CREATE TEMPORARY
VIEW ... USING quiver OPTIONS (...) read the lake end to end (issue 26); a stream's
option typo gets the stream's own options and a did-you-mean."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from tests.lake.helpers import add_file, open_test_tier  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TS_NS = 1_700_000_000_000_000_000


def _lake(tmp_path: Path) -> Path:
    """A lake of two files of client "web" (no daemon: the catalog and the store)."""
    root = tmp_path / "lake"

    async def build() -> None:
        async with open_test_tier(root) as tier:
            await add_file(tier, pa.table({"v": [1, 2]}), client="web", segment=1, ts_ns=TS_NS)
            await add_file(tier, pa.table({"v": [3]}), client="web", segment=2,
                           ts_ns=TS_NS + 5_000)

    anyio.run(build)
    config = tmp_path / "config.toml"
    config.write_text(f'data_dir = "{root}"\n')
    return config


def test_sql_create_table_and_temporary_view_read_the_lake(spark: Any, tmp_path: Path) -> None:
    config = _lake(tmp_path)
    try:
        spark.sql(f"CREATE TABLE web_t USING quiver OPTIONS (client 'web', config '{config}')")
        assert sorted(r.v for r in spark.sql("SELECT v FROM web_t").collect()) == [1, 2, 3]
        assert spark.sql("SELECT count(*) AS n FROM web_t WHERE v > 1").first().n == 2
        assert spark.table("web_t").count() == 3
        spark.sql(f"CREATE TEMPORARY VIEW web_v USING quiver OPTIONS (client 'web', "
                  f"config '{config}', since '{TS_NS + 1_000}')")
        assert [r.v for r in spark.sql("SELECT v FROM web_v").collect()] == [3]
        # The options are checked at CREATE TABLE as for spark.read: a typo is named.
        with pytest.raises(Exception, match='unknown option "clinet" for spark.read.format'
                                            r'\("quiver"\); did you mean "client"\?'):
            spark.sql(f"CREATE TABLE web_bad USING quiver OPTIONS (clinet 'web', "
                      f"config '{config}')")
        # Given a column list, Spark asks quiver nothing at CREATE TABLE and passes no
        # option when it is read: refused, saying what works.
        spark.sql("CREATE TABLE web_cols (v BIGINT) USING quiver OPTIONS (client 'web')")
        with pytest.raises(Exception, match="got no options at all: a table made with "
                                            "CREATE TABLE ... USING quiver and a column list"):
            spark.sql("SELECT * FROM web_cols").collect()
    finally:
        for name in ("web_t", "web_bad", "web_cols"):
            spark.sql(f"DROP TABLE IF EXISTS {name}")
        spark.catalog.dropTempView("web_v")


def test_stream_option_typo_without_schema_names_the_streams_options(spark: Any,
                                                                     tmp_path: Path) -> None:
    config = _lake(tmp_path)
    typo = (spark.readStream.format("quiver").option("config", str(config))
            .option("subscribr", "s1"))
    with pytest.raises(Exception) as caught:
        typo.load("web")
    text = str(caught.value)
    assert ('unknown option "subscribr" for spark.readStream.format("quiver"); did you mean '
            '"subscriber"?') in text
    assert "maxbundlespertrigger" in text and "failondataloss" in text
    assert "skip_quarantined" not in text  # the batch reader's list is not the stream's
