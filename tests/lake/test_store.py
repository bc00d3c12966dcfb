"""The store package: the scheme table, the names of an object (uri, location, key_of,
local_path) and the pyiceberg FileIO properties, on real stores (fs in tmp_path, OpenDAL
memory, s3 configured but never reached: opening a store sends no request)."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from quiverd.kernel import logs
from quiverd.kernel.config import StoreConfig
from quiverd.lake.store import (
    LocalStore,
    ObjectStore,
    S3Store,
    open_store,
    opendal_options,
    store_class,
    store_root,
)

LOG = logs.get("test")
KEY = "client=web/slot=0/n1/web_1_01J0000000000000000000000A.parquet"
S3 = {"bucket": "lake-b", "region": "eu-west-1"}


def s3_store(tmp_path: Path, root: str = "lake", **options: str) -> ObjectStore:
    cfg = StoreConfig(scheme="s3", root=root, options={**S3, **options})
    return open_store(cfg, data_dir=tmp_path, log=LOG)


def test_store_table_chooses_the_class_by_scheme(tmp_path: Path) -> None:
    assert store_class("fs") is LocalStore and store_class("s3") is S3Store
    assert store_class("memory") is ObjectStore and store_class("gcs") is ObjectStore
    fs = open_store(StoreConfig(), data_dir=tmp_path, log=LOG)
    assert type(fs) is LocalStore and fs.is_local
    # open_store: the table picks the class.
    assert type(open_store(StoreConfig(), data_dir=tmp_path, log=LOG)) is LocalStore
    memory = open_store(StoreConfig(scheme="memory"), data_dir=tmp_path, log=LOG)
    assert type(memory) is ObjectStore and not memory.is_local
    assert type(s3_store(tmp_path)) is S3Store and not S3Store.is_local


def test_store_root_and_options_from_config_alone(tmp_path: Path) -> None:
    fs = StoreConfig()
    assert store_root(fs, data_dir=tmp_path) == str(tmp_path / "objects")
    assert store_root(StoreConfig(root="rel"), data_dir=tmp_path) == str(Path("rel").absolute())
    opts = opendal_options(fs, data_dir=tmp_path)
    assert opts == {"root": str(tmp_path / "objects"),
                    "atomic_write_dir": str(tmp_path / "objects" / ".tmp")}
    assert not (tmp_path / "objects").exists()  # the class methods do no I/O
    s3 = StoreConfig(scheme="s3", root="lake", options=S3)
    assert store_root(s3, data_dir=tmp_path) == "lake"
    assert opendal_options(s3, data_dir=tmp_path) == {**S3, "root": "lake",
                                                       "disable_config_load": "true"}
    assert LocalStore.file_under("/r", KEY) == Path("/r", KEY)
    assert S3Store.file_under("lake", KEY) is None


def test_store_fs_uri_is_plain_and_location_unencoded(tmp_path: Path) -> None:
    store = open_store(StoreConfig(), data_dir=tmp_path, log=LOG)
    root = tmp_path / "objects"
    assert store.uri(KEY) == f"file://{root}/{KEY}"  # '=' stays: client=web
    assert "%" not in store.uri(KEY)
    assert store.location(KEY) == f"file://{root}/{KEY}"
    assert store.local_path(KEY) == root / KEY
    assert store.uri("") == f"file://{root}"
    # What a URI must encode still is; the location never is.
    odd = "client=a b/slot=0/n1/x#1?%.parquet"
    assert store.uri(odd) == f"file://{root}/client=a%20b/slot=0/n1/x%231%3F%25.parquet"
    assert store.location(odd) == f"file://{root}/{odd}"
    assert urllib.parse.unquote(urllib.parse.urlsplit(store.uri(odd)).path) == str(root / odd)


def test_store_fs_key_of_reads_new_old_and_location_forms(tmp_path: Path) -> None:
    store = open_store(StoreConfig(), data_dir=tmp_path, log=LOG)
    old = (tmp_path / "objects" / KEY).as_uri()  # before issue 20: client%3Dweb
    assert "client%3Dweb" in old
    for form in (store.uri(KEY), old, store.location(KEY)):
        assert store.key_of(form) == KEY, form
    odd = "client=a b/slot=0/n1/x#1.parquet"
    assert store.key_of(store.uri(odd)) == odd
    assert store.key_of((tmp_path / "objects" / odd).as_uri()) == odd
    for foreign in (f"file://{tmp_path}/other/{KEY}", f"s3://b/{KEY}", store.uri(""),
                    store.uri(".tmp/x.1"), f"file://{tmp_path}/objects/../{KEY}"):
        assert store.key_of(foreign) is None, foreign


def test_store_s3_names(tmp_path: Path) -> None:
    store = s3_store(tmp_path)
    assert store.uri(KEY) == store.location(KEY) == f"s3://lake-b/lake/{KEY}"
    assert store.uri("") == "s3://lake-b/lake"
    assert store.key_of(f"s3://lake-b/lake/{KEY}") == KEY
    assert store.key_of(f"s3://lake-b/other/{KEY}") is None
    assert store.local_path(KEY) is None
    bare = s3_store(tmp_path, root="")
    assert bare.location(KEY) == f"s3://lake-b/{KEY}" and bare.key_of(f"s3://lake-b/{KEY}") == KEY
    memory = open_store(StoreConfig(scheme="memory"), data_dir=tmp_path, log=LOG)
    assert memory.location(KEY) == f"memory://{KEY}" and memory.key_of(f"memory://{KEY}") == KEY


def test_store_iceberg_io_properties_fs_and_memory_are_empty(tmp_path: Path) -> None:
    assert open_store(StoreConfig(), data_dir=tmp_path, log=LOG).iceberg_io_properties() == {}
    memory = open_store(StoreConfig(scheme="memory"), data_dir=tmp_path, log=LOG)
    assert memory.iceberg_io_properties() == {}


@pytest.mark.parametrize(("options", "expected"), [
    ({}, {"s3.region": "eu-west-1", "s3.force-virtual-addressing": "false",
          "s3.path-style-access": "true"}),
    ({"endpoint": "http://127.0.0.1:9000", "access_key_id": "AK", "secret_access_key": "SK",
      "session_token": "TOK"},
     {"s3.endpoint": "http://127.0.0.1:9000", "s3.region": "eu-west-1",
      "s3.access-key-id": "AK", "s3.secret-access-key": "SK", "s3.session-token": "TOK",
      "s3.force-virtual-addressing": "false", "s3.path-style-access": "true"}),
    ({"enable_virtual_host_style": "true", "access_key_id": "AK", "secret_access_key": "SK"},
     {"s3.region": "eu-west-1", "s3.access-key-id": "AK", "s3.secret-access-key": "SK",
      "s3.force-virtual-addressing": "true", "s3.path-style-access": "false"}),
])
def test_store_s3_iceberg_io_properties_map_the_store_options(
        tmp_path: Path, options: dict[str, str], expected: dict[str, Any]) -> None:
    assert s3_store(tmp_path, **options).iceberg_io_properties() == expected


def test_store_keys_withheld_lets_an_s3_reader_find_its_own() -> None:
    options = {"bucket": "b", "region": "r"}
    store_class("s3").keys_withheld(options)
    assert options["disable_config_load"] == "false"
    options = {"root": "/r"}
    store_class("fs").keys_withheld(options)
    assert options == {"root": "/r"}
