"""``quiverd check-config --probe`` reaches the lake's real store (moto S3) and catalog
(the suite's PostgreSQL) and names what is wrong in one error with a hint."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProcess
from tests.daemon.lake_helpers import quiverd_cli

pytestmark = pytest.mark.timeout(120)


def config(root: Path, settings: dict[str, Any]) -> Path:
    return DaemonProcess(root, settings, {}).config_path


def s3(options: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"lake.store.scheme": "s3", "lake.store.root": "lake",
                           "lake.store.max_attempts": 2, "lake.store.retry_max_ms": 100}
    out.update({f"lake.store.options.{k}": v for k, v in options.items()})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_probe_good_bucket_and_postgres_ok_and_leaves_nothing(
        short_dir: Path, s3_server: Any, s3_bucket: dict[str, str], pg_catalog_dsn: str) -> None:
    path = config(short_dir, {**s3(s3_bucket), "catalog.dsn": pg_catalog_dsn})
    plain = quiverd_cli("check-config", str(path))
    assert plain.returncode == 0, plain.stderr
    done = quiverd_cli("check-config", "--probe", str(path))
    assert done.returncode == 0, done.stderr
    assert f"store s3://{s3_bucket['bucket']}/lake: ok" in done.stdout, done.stdout
    assert "catalog postgresql: ok" in done.stdout, done.stdout
    listed = s3_server.client().list_objects_v2(Bucket=s3_bucket["bucket"])
    assert listed.get("KeyCount", 0) == 0  # the probe object was deleted


def test_probe_missing_bucket_fails_naming_it(
        short_dir: Path, s3_server: Any, s3_bucket: dict[str, str]) -> None:
    missing = s3_bucket["bucket"] + "-nope"
    path = config(short_dir, s3({**s3_bucket, "bucket": missing}))
    assert quiverd_cli("check-config", str(path)).returncode == 0  # fine on paper
    done = quiverd_cli("check-config", "--probe", str(path))
    assert done.returncode != 0
    first = done.stderr.splitlines()[0]
    assert first.startswith("quiverd: probe of lake.store"), done.stderr
    assert "bucket does not exist" in first and missing in first, done.stderr
    assert "hint:" in done.stderr and "create the bucket" in done.stderr, done.stderr


def test_probe_postgres_wrong_port_fails(
        short_dir: Path, s3_server: Any, s3_bucket: dict[str, str], pg_catalog_dsn: str) -> None:
    port = free_port()
    dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    path = config(short_dir, {**s3(s3_bucket), "catalog.dsn": dsn,
                              "catalog.connect_timeout_ms": 2000})
    done = quiverd_cli("check-config", "--probe", str(path))
    assert done.returncode != 0, done.stdout
    assert done.stderr.startswith("quiverd: probe of the catalog (postgresql) failed"), \
        done.stderr
    assert "hint:" in done.stderr and "catalog.dsn" in done.stderr, done.stderr


def test_probe_fresh_install_own_store_root_ok_and_creates_nothing(tmp_path: Path) -> None:
    """A fresh install whose store root is not under data_dir: data_dir does not exist
    yet (serve creates it); the probe says so, migrates a scratch catalog and writes
    nothing there, instead of failing with SQLITE_CANTOPEN and a catalog.dsn hint."""
    data_dir = tmp_path / "data"
    path = tmp_path / "config.toml"
    path.write_text(f'data_dir = "{data_dir}"\n[lake.store]\nroot = "{tmp_path / "store"}"\n')
    done = quiverd_cli("check-config", "--probe", str(path))
    assert done.returncode == 0, done.stderr
    assert "catalog sqlite: ok" in done.stdout and "serve creates it" in done.stdout, done.stdout
    assert not data_dir.exists()


def test_probe_fresh_install_data_dir_parent_missing_names_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "typo" / "data"
    path = tmp_path / "config.toml"
    path.write_text(f'data_dir = "{data_dir}"\n[lake.store]\nroot = "{tmp_path / "store"}"\n')
    done = quiverd_cli("check-config", "--probe", str(path))
    assert done.returncode == 1
    first = done.stderr.splitlines()[0]
    assert first.startswith("quiverd: data_dir: probe of the catalog (sqlite) failed"), first
    assert f"its parent {tmp_path / 'typo'} does not exist" in first, first
    assert "catalog.dsn" not in done.stderr
