"""A real S3 endpoint for the lake tests: moto's server on loopback, objects in RAM.

``s3_server`` (session) runs ``ThreadedMotoServer``; ``s3_bucket`` makes a fresh bucket
per test and returns OpenDAL ``s3`` options for it; ``s3_faults`` puts a ``FaultProxy``
between OpenDAL and moto and returns a handle whose ``.options`` point at the proxy.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.services.faultproxy import FaultProxy

ACCESS_KEY_ID = "quiverd-test"  # moto accepts any credentials; never the caller's own
SECRET_ACCESS_KEY = "quiverd-test-secret"
REGION = "us-east-1"
SETUP_HINT = "moto is not installed: run scripts/setup (test extras: moto[s3], flask, boto3)"


class S3Server:
    def __init__(self, endpoint: str, host: str, port: int) -> None:
        self.endpoint = endpoint
        self.host = host
        self.port = port

    def client(self) -> Any:
        """A boto3 S3 client with dummy credentials set explicitly (no ~/.aws)."""
        import boto3

        return boto3.session.Session(
            aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key=SECRET_ACCESS_KEY,
            region_name=REGION).client("s3", endpoint_url=self.endpoint)


class S3Faults:
    """The ``s3_faults`` fixture: a bucket behind a fault proxy."""

    def __init__(self, proxy: FaultProxy, bucket_options: dict[str, str]) -> None:
        self.proxy = proxy
        self.options = {**bucket_options, "endpoint": proxy.url}
        self.direct_options = bucket_options  # straight to moto, for checking afterwards
        self.pass_through = proxy.pass_through
        self.fail = proxy.fail
        self.throttle = proxy.throttle
        self.deny = proxy.deny
        self.delay = proxy.delay
        self.reset = proxy.reset
        self.corrupt = proxy.corrupt

    @property
    def requests(self) -> list[str]:
        return list(self.proxy.requests)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        pytest.skip(SETUP_HINT)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(f"http://{host}:{port}", host, port)
    finally:
        server.stop()
        # stop() ends serve_forever but leaves the listening socket open.
        wsgi = getattr(server, "_server", None)
        if wsgi is not None:
            wsgi.server_close()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[dict[str, str]]:
    """A fresh bucket; OpenDAL ``s3`` options for it (path-style, no config loading)."""
    client = s3_server.client()
    bucket = f"quiverd-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=bucket)
    yield {
        "bucket": bucket,
        "endpoint": s3_server.endpoint,
        "region": REGION,
        "access_key_id": ACCESS_KEY_ID,
        "secret_access_key": SECRET_ACCESS_KEY,
        # OpenDAL addresses buckets path-style unless enable_virtual_host_style is set,
        # which is what moto on a bare IP needs; never read ~/.aws or AWS_* variables.
        "disable_config_load": "true",
        "disable_ec2_metadata": "true",
    }
    _empty_bucket(client, bucket)  # moto keeps objects in RAM for the whole session
    client.close()


@pytest.fixture
def s3_faults(s3_server: S3Server, s3_bucket: dict[str, str]) -> Iterator[S3Faults]:
    proxy = FaultProxy((s3_server.host, s3_server.port))
    try:
        yield S3Faults(proxy, s3_bucket)
    finally:
        proxy.stop()


def _empty_bucket(client: Any, bucket: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    for upload in uploads:
        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"],
                                      UploadId=upload["UploadId"])
    client.delete_bucket(Bucket=bucket)
