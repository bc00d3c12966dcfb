"""One way to name the daemon (quiverd.spark.locator): a socket or a config, for the reader
and the writer alike; given only the socket, the reader asks the daemon where its lake is."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client  # noqa: E402 - after the skip
from quiverd.kernel.config import load  # noqa: E402
from quiverd.kernel.errors import ConfigError, DaemonUnreachable, ProtocolError  # noqa: E402
from quiverd.protocol.frames import ErrorCode  # noqa: E402
from quiverd.spark import locator  # noqa: E402
from quiverd.spark.locator import Locator, config_of, resolve, writer_sockets  # noqa: E402
from quiverd.spark.objects import open_object  # noqa: E402
from quiverd.spark.paths import local_paths  # noqa: E402
from quiverd.spark.reader import Lake, Selection  # noqa: E402
from tests.daemon.lake_helpers import FAST_LAKE, send_logs, wait_for_lake  # noqa: E402
from tests.daemon.test_lake_pg_s3 import _s3_settings  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No $QUIVERD_SOCKET, and the default socket and config moved under tmp_path."""
    monkeypatch.delenv(locator.SOCKET_ENV, raising=False)
    monkeypatch.setattr(locator, "DEFAULT_SOCKET", str(tmp_path / "ingest.sock"))
    monkeypatch.setattr(locator, "DEFAULT_CONFIG", str(tmp_path / "config.toml"))
    return tmp_path


def test_locator_defaults_in_order_and_the_error_names_each_one_tried(
        nowhere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as info:
        locator.defaults(Locator())
    text = str(info.value)
    for tried in ('option "socket"', "$QUIVERD_SOCKET not set", str(nowhere / "ingest.sock"),
                  str(nowhere / "config.toml")):
        assert tried in text, tried
    (nowhere / "config.toml").write_text(f'data_dir = "{nowhere}"\n')
    assert locator.defaults(Locator()) == ("", str(nowhere / "config.toml"),
                                           " (the default config)")
    (nowhere / "ingest.sock").touch()
    assert locator.defaults(Locator())[:2] == (str(nowhere / "ingest.sock"), "")
    monkeypatch.setenv(locator.SOCKET_ENV, "/run/q.sock")
    assert locator.defaults(Locator()) == ("/run/q.sock", "", " (from $QUIVERD_SOCKET)")
    assert locator.defaults(Locator(config="/c.toml")) == ("", "/c.toml", "")
    located = resolve({"CONFIG": str(nowhere / "config.toml")})
    assert located.socket == str(nowhere / "ingest.sock") and located.config_path


def test_locator_one_daemon_named_once() -> None:
    with pytest.raises(ValueError, match='"socket" .* and "config" .* both name the daemon'):
        Locator.parse({"socket": "/a.sock", "config": "/c.toml"})
    with pytest.raises(ValueError, match='"config" and "path" both name the daemon'):
        writer_sockets({"path": "/a.sock", "config": "/c.toml"})
    with pytest.raises(ValueError, match='"path" .* and "socket" .* name two sockets'):
        writer_sockets({"path": "/a.sock", "socket": "/b.sock"})
    assert writer_sockets({"path": "/a.sock", "socket": "/a.sock"}) == (("/a.sock",), "")
    assert writer_sockets({"socket": "/b.sock"}) == (("/b.sock",), "")
    with pytest.raises(ValueError, match='load\\("web"\\) names client .web., option '
                       '"client" .app.'):
        Selection.parse({"path": "web", "client": "app"})
    assert Selection.parse({"path": "web"}).client == "web"  # load("web")
    with pytest.raises(ValueError, match='unknown option "sinse" for spark.read.format'
                       '\\("quiver"\\); did you mean "since"'):
        Selection.parse({"client": "web", "sinse": "2025-01-01"})


def test_locator_writer_default_socket_says_how_it_was_chosen(nowhere: Path) -> None:
    sockets, why = writer_sockets({})
    assert sockets == (str(nowhere / "ingest.sock"),) and "$QUIVERD_SOCKET not set" in why
    (nowhere / "config.toml").write_text(f'data_dir = "{nowhere}/d"\n')
    assert writer_sockets({}) == ((f"{nowhere}/d/ingest.sock",),
                                  f" (from {nowhere / 'config.toml'})")


def test_locator_withheld_s3_keys_let_the_reader_use_its_environment() -> None:
    info = {"data_dir": "/srv/q", "node_id": "n",
            "catalog": {"dsn": "postgresql://quiver@db/lake", "file": ""},
            "lake": {"time_column": "ts", "store": {
                "scheme": "s3", "root": "p", "options": {"bucket": "b", "region": "r"}}},
            "withheld": ["lake.store.options.secret_access_key"]}
    cfg = config_of(info)
    assert cfg.catalog.dsn == "postgresql://quiver@db/lake" and cfg.lake.time_column == "ts"
    assert cfg.lake.store.options == {"bucket": "b", "region": "r",
                                      "disable_config_load": "false"}
    info["withheld"] = []
    assert "disable_config_load" not in config_of(info).lake.store.options


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
