"""JOB lake's answer (quiverd.net.whereabouts): the lake's places, never its secrets."""

from __future__ import annotations

import json

import pytest

from quiverd.kernel.config import loads
from quiverd.kernel.errors import ProtocolError
from quiverd.net import jobs
from quiverd.net.whereabouts import is_secret, lake_reply


def test_lake_reply_withholds_the_dsn_password_and_store_keys_and_names_them() -> None:
    cfg = loads('''
data_dir = "/srv/q"
[catalog]
dsn = "postgresql://quiver:hunter2@db.example:5432/lake?sslmode=require&sslpassword=pw9"
[lake]
node_id = "node-a"
time_column = "ts"
[lake.store]
scheme = "s3"
root = "prefix"
[lake.store.options]
bucket = "b"
region = "eu-west-1"
endpoint = "http://s3.local:9000"
access_key_id = "AKIAEXAMPLE"
secret_access_key = "s3cr3t"
session_token = "tok"
''')
    reply = lake_reply(cfg)
    text = json.dumps(reply)
    for secret in ("hunter2", "pw9", "AKIAEXAMPLE", "s3cr3t", "tok\""):
        assert secret not in text, secret
    assert reply["catalog"]["dsn"] == "postgresql://quiver@db.example:5432/lake?sslmode=require"
    assert reply["catalog"]["file"] == ""
    assert reply["lake"]["store"] == {
        "scheme": "s3", "root": "prefix", "timeout_ms": 120_000, "max_attempts": 8,
        "options": {"bucket": "b", "endpoint": "http://s3.local:9000", "region": "eu-west-1"}}
    assert reply["lake"]["time_column"] == "ts" and reply["node_id"] == "node-a"
    assert reply["withheld"] == [
        "catalog.dsn password", "catalog.dsn sslpassword",
        "lake.store.options.access_key_id", "lake.store.options.secret_access_key",
        "lake.store.options.session_token"]


def test_lake_reply_embedded_answers_its_files_and_withholds_nothing() -> None:
    reply = lake_reply(loads('data_dir = "/srv/q"\n'))
    assert reply["catalog"] == {"dsn": "", "file": "/srv/q/catalog.sqlite",
                                "connect_timeout_ms": 5000, "pool_size": 4}
    assert reply["lake"]["store"]["root"] == "/srv/q/objects"
    assert reply["lake"]["time_column"] == "_quiver_ingested_at"
    assert reply["withheld"] == [] and reply["node_id"]


def test_secret_names_are_matched_widely() -> None:
    for name in ("secret_access_key", "account_key", "sas_token", "credential_path",
                 "Password", "server_side_encryption_customer_key"):
        assert is_secret(name), name
    for name in ("bucket", "region", "endpoint", "enable_virtual_host_style", "container"):
        assert not is_secret(name), name


def test_job_lake_parses_without_a_job_id_and_refuses_extra_fields() -> None:
    assert isinstance(jobs.parse({"op": "lake"}), jobs.Lake)
    with pytest.raises(ProtocolError, match="JOB lake"):
        jobs.parse({"op": "lake", "job_id": "x"})
