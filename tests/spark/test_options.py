"""Unknown options are refused with a did-you-mean, by the reader and the writer, under a
real Spark (which passes them as the user spelled them); the names Spark adds itself
are never refused. The refusal itself, without Spark: tests/sparkless/test_options.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

pytestmark = pytest.mark.timeout(120)


def test_options_unknown_read_and_write_options_fail_in_spark_with_a_did_you_mean(
        spark: Any, tmp_path: Path) -> None:
    with pytest.raises(Exception) as info:
        (spark.read.format("quiver").option("client", "web")
         .option("sinse", "2025-06-01T00:00:00Z").load())
    assert 'unknown option "sinse" for spark.read.format("quiver"); did you mean "since"?' \
        in str(info.value)
    df = spark.range(10)
    with pytest.raises(Exception) as info:
        df.write.format("quiver").mode("append").option("job_idd", "x").save("/nowhere.sock")
    assert 'unknown option "job_idd" for df.write.format("quiver"); did you mean "job_id"?' \
        in str(info.value)
    # writeStream: checkpointLocation and start(path) come from Spark, the typo from us.
    stream = spark.readStream.format("rate").load()
    with pytest.raises(Exception) as info:
        q = (stream.writeStream.format("quiver").option("checkpointLocation",
                                                        str(tmp_path / "ck"))
             .option("query_idd", "q").start("/nowhere.sock"))
        q.awaitTermination(60)
    assert 'unknown option "query_idd" for df.writeStream.format("quiver"); did you mean ' \
        '"query_id"?' in str(info.value)
