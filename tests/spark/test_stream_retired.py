"""A Spark stream query whose subscriber was retired (runtime.retirement) fails saying why.

An experiment: a query reads subscriber ``exp`` once and is left. A producer keeps
sending into a 6 MiB cap, another subscriber consumes; ``exp`` is retired before the cap
holds ingest back, and the query, started again from its checkpoint, fails with the
retirement's reason instead of registering the subscriber anew from ``latest``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.daemon.test_retirement import RETIRE, Consumer, Producer
from tests.daemon.test_subscribers import add
from tests.spark.test_stream_source import SCHEMA, expect, finalized, produce, rows_of, wait_for


@pytest.mark.timeout(300)
def test_stream_query_on_a_retired_subscriber_fails_with_the_reason(spark, daemon_factory,
                                                                    tmp_path: Path):
    d = daemon_factory(RETIRE).start()
    produce(d, range(4))
    wait_for(lambda: finalized(d) >= 4, what="4 finalized bundles")
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"

    def run() -> Any:
        q = (spark.readStream.format("quiver").schema(SCHEMA).option("socket", str(d.socket))
             .option("subscriber", "exp").option("client", "a").load()
             .writeStream.format("parquet").option("path", str(out))
             .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start())
        try:
            q.awaitTermination(120)
        except Exception:  # noqa: BLE001 - q.exception() has it
            pass
        return q

    assert run().exception() is None  # registers "exp" and reads what is there
    assert sorted(rows_of(spark, out)) == expect(range(4))
    add(d, "live")  # the subscriber that stays: the lake's, or a real job's
    live = Consumer(d, "live")
    live.start()
    assert live.attached.wait(10)
    producer = Producer(d, 40)  # ~8 MB into the 6 MiB cap while "exp" is left
    producer.start()
    producer.join(120)
    assert producer.error is None
    metrics = d.status()["metrics"]
    assert metrics["quiver_subscribers_retired_total"] == {"lag_bytes": 1}
    assert metrics["quiver_ingest_throttle_total"] == 0
    failed = run().exception()
    assert failed is not None, "the query went on with a retired subscriber"
    text = str(failed)
    assert "subscriber 'exp' was retired at" in text and "its lag reached" in text
    assert "quiverd subscribers add exp" in text
    print("\n" + next(line for line in text.splitlines() if "was retired" in line)[:400])
    live.stop.set()
    live.join(10)
    assert d.stop() == 0
