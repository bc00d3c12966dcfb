"""One way to name the daemon (quiverd.spark.locator): a socket or a config, for the reader
and the writer alike; given only the socket, the reader asks the daemon where its lake is.
The parts that need no daemon and no Spark (defaults, the writer's sockets, a JOB lake
answer as a config) are in tests/sparkless/test_locator.py."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client  # noqa: E402 - after the skip
from quiverd.kernel.config import load  # noqa: E402
from quiverd.kernel.errors import ConfigError, DaemonUnreachable, ProtocolError  # noqa: E402
from quiverd.protocol.frames import ErrorCode  # noqa: E402
from quiverd.spark import locator  # noqa: E402
from quiverd.spark.locator import Locator, resolve  # noqa: E402
from quiverd.spark.objects import open_object  # noqa: E402
from quiverd.spark.paths import local_paths  # noqa: E402
from quiverd.spark.reader import Lake, Selection  # noqa: E402
from tests.daemon.lake_helpers import FAST_LAKE, send_logs, wait_for_lake  # noqa: E402
from tests.daemon.test_lake_pg_s3 import _s3_settings  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_locator_reader_names_one_client_and_refuses_unknown_options() -> None:
    # The daemon named once, by the writer and Locator.parse: tests/sparkless/test_locator.py.
    with pytest.raises(ValueError, match='load\\("web"\\) names client .web., option '
                       '"client" .app.'):
        Selection.parse({"path": "web", "client": "app"})
    assert Selection.parse({"path": "web"}).client == "web"  # load("web")
    with pytest.raises(ValueError, match='unknown option "sinse" for spark.read.format'
                       '\\("quiver"\\); did you mean "since"'):
        Selection.parse({"client": "web", "sinse": "2025-01-01"})


def test_locator_reader_given_only_the_socket_reads_what_the_writer_wrote(
        daemon_factory: Any, spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark.sql import functions as F

    d = daemon_factory({**FAST_LAKE}).start()
    sock, config = str(d.socket), str(d.config_path)
    df = spark.range(0, 300, 1, 2).select("id", (F.col("id") * 7).alias("h"))
    # save(socket): Spark passes it as option "path", the writer's socket.
    df.write.format("quiver").mode("append").option("client", "loc").save(sock)
    wait_for_lake(d, Counter({("loc", 0): 300}))
    want = (300, 7 * sum(range(300)))
    # load(client): Spark passes it as option "path", the reader's client.
    by_socket = spark.read.format("quiver").option("socket", sock).load("loc")
    assert tuple(by_socket.agg(F.count("*"), F.sum("h")).first()) == want
    spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW loc_view USING quiver "
              f"OPTIONS (client 'loc', socket '{sock}')")
    assert tuple(spark.sql("SELECT count(*), sum(h) FROM loc_view").first()) == want
    # The daemon's answer opens the same lake as its config file.
    asked, read = Lake.open(Locator(socket=sock)), Lake.open(config)
    assert asked.store_options == read.store_options
    assert asked.time_column == read.time_column
    assert asked.cfg.data_dir == load(config).data_dir
    assert local_paths(socket=sock, client="loc") == local_paths(config, client="loc") != []
    with Client.connect(sock) as c:
        assert c.lake_info()["withheld"] == []
    monkeypatch.setenv(locator.SOCKET_ENV, sock)
    located = resolve({})
    assert (located.socket, str(located)) == (sock, f"the daemon at {sock} (from "
                                              "$QUIVERD_SOCKET)")
    with pytest.raises(DaemonUnreachable, match="no quiverd socket at /nowhere.sock "
                       "\\(from \\$QUIVERD_SOCKET\\): the reader asks the daemon there"):
        monkeypatch.setenv(locator.SOCKET_ENV, "/nowhere.sock")
        resolve({})
    # A daemon older than JOB lake answers MALFORMED: the error says to name its config.
    def older(self: Client) -> dict[str, Any]:
        raise ProtocolError(ErrorCode.MALFORMED, "JOB op must be one of ['abort', ...]")

    monkeypatch.setattr(Client, "lake_info", older)
    with pytest.raises(ConfigError, match=f"the daemon at {sock} does not say where its "
                       "lake is .*older than this reader"):
        resolve({"socket": sock})
    assert os.path.exists(sock)
    assert d.stop() == 0


def test_locator_s3_keys_withheld_the_reader_reads_with_its_own(
        daemon_factory: Any, s3_bucket: dict[str, str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    import pyarrow.parquet as pq

    d = daemon_factory({**FAST_LAKE, **_s3_settings(s3_bucket)}).start()
    sent = send_logs(d, clients=1, batches=2)
    wait_for_lake(d, sent)
    with Client.connect(d.socket) as c:
        info = c.lake_info()
    assert s3_bucket["secret_access_key"] not in str(info)
    assert s3_bucket["access_key_id"] not in str(info)
    assert info["withheld"] == ["lake.store.options.access_key_id",
                                "lake.store.options.secret_access_key"]
    sel = Selection.parse({"socket": str(d.socket), "client": "client-0"})
    lake = Lake.open(sel.locator)
    assert lake.store_options["bucket"] == s3_bucket["bucket"]
    assert lake.store_options["disable_config_load"] == "false"
    rows, _ = lake.query(sel, zone_maps=False)
    assert sum(r.row_count for r in rows) == sent[("client-0", 0)]
    # Without any (no AWS_* variables, no ~/.aws files), no request is signed.
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.setenv(name, "/nonexistent")
    for name in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(Exception, match="(?i)credential"):
        open_object(lake.partition(rows[0]))
    # The reader's own credentials, from its environment (here moto's test keys).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_bucket["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_bucket["secret_access_key"])
    source = open_object(lake.partition(rows[0]))
    try:
        assert pq.ParquetFile(source).metadata.num_rows == rows[0].row_count
    finally:
        source.close()
    assert d.stop() == 0
