"""quiverd.spark.locator without Spark: naming the daemon by socket or config, the
defaults in order, the writer's sockets, and a daemon's JOB lake answer as a config.
Asking a live daemon is tested with Spark, in tests/spark/test_locator.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from quiverd.kernel.errors import ConfigError, DaemonUnreachable
from quiverd.spark import locator
from quiverd.spark.locator import Locator, config_of, resolve, writer_sockets


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


def test_locator_defaults_blank_env_is_unset_and_the_error_says_how_to_name_one(
        nowhere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(locator.SOCKET_ENV, "  ")
    with pytest.raises(ConfigError) as info:
        locator.defaults(Locator())
    assert 'option("socket", "<data_dir>/ingest.sock")' in (info.value.hint or "")
    (nowhere / "ingest.sock").touch()
    assert locator.defaults(Locator()) == (str(nowhere / "ingest.sock"), "",
                                           " (the default socket)")


def test_locator_parse_one_daemon_named_once_and_its_str() -> None:
    with pytest.raises(ValueError, match='"socket" .* and "config" .* both name the daemon'):
        Locator.parse({"socket": "/a.sock", "config": "/c.toml"})
    assert Locator.parse({"socket": " /a.sock ", "config": " "}) == Locator(socket="/a.sock")
    assert str(Locator(socket="/a.sock")) == "the daemon at /a.sock"
    assert str(Locator(config="/c.toml")) == "/c.toml"
    assert str(Locator()) == "the default daemon"


def test_locator_resolve_from_a_config_reads_its_lake(nowhere: Path) -> None:
    config = nowhere / "q.toml"
    config.write_text(f'data_dir = "{nowhere}/d"\n[lake]\ntime_column = "ts"\n')
    located = resolve(Locator(config=str(config)))
    assert (located.socket, located.config_path) == (f"{nowhere}/d/ingest.sock", str(config))
    assert located.cfg.lake.time_column == "ts" and str(located) == str(config)
    assert located.withheld == ()
    (nowhere / "config.toml").write_text(f'data_dir = "{nowhere}/e"\n')
    by_default = resolve({})
    assert str(by_default) == f"{nowhere / 'config.toml'} (the default config)"
    with pytest.raises(ConfigError, match="cannot read config"):
        resolve({"config": str(nowhere / "missing.toml")})


def test_locator_resolve_a_socket_with_no_daemon_says_what_the_reader_asked(
        short_dir: Path) -> None:
    sock = str(short_dir / "none.sock")
    with pytest.raises(DaemonUnreachable, match=f"{sock}.*: the reader asks the daemon "
                       "there where its lake is"):
        resolve({"socket": sock})


def test_locator_one_daemon_named_once_by_the_writer() -> None:
    with pytest.raises(ValueError, match='"config" and "path" both name the daemon'):
        writer_sockets({"path": "/a.sock", "config": "/c.toml"})
    with pytest.raises(ValueError, match='"config" and "paths" both name the daemon'):
        writer_sockets({"paths": "/a.sock,/b.sock", "config": "/c.toml"})
    with pytest.raises(ValueError, match='"path" .* and "socket" .* name two sockets'):
        writer_sockets({"path": "/a.sock", "socket": "/b.sock"})
    assert writer_sockets({"path": "/a.sock", "socket": "/a.sock"}) == (("/a.sock",), "")
    assert writer_sockets({"socket": "/b.sock"}) == (("/b.sock",), "")
    # paths wins over path; blanks between the commas are dropped.
    assert writer_sockets({"paths": " /a.sock, ,/b.sock ", "path": "/x"}) == \
        (("/a.sock", "/b.sock"), "")


def test_locator_writer_default_socket_says_how_it_was_chosen(nowhere: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    sockets, why = writer_sockets({})
    assert sockets == (str(nowhere / "ingest.sock"),) and "$QUIVERD_SOCKET not set" in why
    (nowhere / "config.toml").write_text(f'data_dir = "{nowhere}/d"\n')
    assert writer_sockets({}) == ((f"{nowhere}/d/ingest.sock",),
                                  f" (from {nowhere / 'config.toml'})")
    other = nowhere / "other.toml"
    other.write_text(f'data_dir = "{nowhere}/o"\n')
    assert writer_sockets({"config": str(other)}) == ((f"{nowhere}/o/ingest.sock",),
                                                      f" (from {other})")
    monkeypatch.setenv(locator.SOCKET_ENV, "/run/q.sock")
    assert writer_sockets({}) == (("/run/q.sock",), " (from $QUIVERD_SOCKET)")


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


def test_locator_config_of_keeps_the_lake_keys_and_defaults_the_rest() -> None:
    info = {"data_dir": "/srv/q", "catalog": {"dsn": "", "pool_size": 3, "secret": "x"},
            "lake": {"store": {"scheme": "fs", "root": "/srv/lake", "timeout_ms": 1234,
                               "max_attempts": 2, "extra": "dropped"}}}
    cfg = config_of(info)
    assert (str(cfg.data_dir), cfg.catalog.pool_size, cfg.lake.node_id) == ("/srv/q", 3, "")
    assert (cfg.lake.store.scheme, cfg.lake.store.root, cfg.lake.store.timeout_ms,
            cfg.lake.store.max_attempts) == ("fs", "/srv/lake", 1234, 2)
    with pytest.raises(ConfigError, match="the daemon's answer to JOB lake does not fit a "
                       "config"):
        config_of({**info, "catalog": {"pool_size": "many"}})
