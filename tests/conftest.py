"""Shared fixtures: a real etcd server (tests/support/etcd_fixture.py) and real service
processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pegaflow.tools.devcluster import Proc, start_server

pytest_plugins = ["tests.support.etcd_fixture"]


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Service processes a test starts (append them): killed when it ends."""
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    """A small ``pegaflow-server`` (32 MiB pool in 4 MiB slabs) for one test module;
    ``server.ready['coordinator']`` is its address."""
    p = start_server(extra=["--node-pool-bytes", "32MiB", "--node-slab-bytes", "4MiB"])
    try:
        yield p
    finally:
        p.terminate()
