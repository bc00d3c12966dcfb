"""Unknown options are refused with a did-you-mean, by the reader and the writer, under a
real Spark (which passes them as the user spelled them); the names Spark adds itself
are never refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.spark.options import READ, STREAM_READ, WRITE, refuse_unknown  # noqa: E402
from quiverd.spark.writer import WriteOptions  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_options_refuse_unknown_names_the_closest_and_ignores_case() -> None:
    refuse_unknown({"Client": "w", "SINCE": "1", "checkpointLocation": "/c"},
                   READ | {"checkpointlocation"}, "r")
    with pytest.raises(ValueError, match='unknown option "batch_row" for df.write.format'
                       '\\("quiver"\\); did you mean "batch_rows"\\? \\(known: '):
        WriteOptions.parse({"batch_row": "5"})
    with pytest.raises(ValueError, match='unknown option "zzz" for w \\(known: '):
        refuse_unknown({"zzz": 1}, WRITE, "w")
    assert not any(n.startswith("_") for n in STREAM_READ)
    with pytest.raises(ValueError, match='"if_committed" must be one of skip, verify, error'):
        WriteOptions.parse({"if_committed": "ignore"})


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
