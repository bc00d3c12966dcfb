"""``make_server``: fake quiverd servers on real Unix sockets (tests/client/fake_server.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.client.fake_server import FakeJobs, FakeServer, Responder, ack_all


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., FakeServer]]:
    servers: list[FakeServer] = []

    def make(*, max_inflight: int = 4, batch: int = 1, respond: Responder = ack_all,
             hello_error: tuple[int, str] | None = None, jobs: FakeJobs | None = None,
             max_bundle_bytes: int = 1 << 20,
             hold: Callable[[Any], bool] | None = None) -> FakeServer:
        server = FakeServer(tmp_path / f"q{len(servers)}.sock", max_inflight=max_inflight,
                            batch=batch, respond=respond, hello_error=hello_error, jobs=jobs,
                            max_bundle_bytes=max_bundle_bytes, hold=hold)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()
