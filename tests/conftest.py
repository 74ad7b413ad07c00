"""Shared fixtures: a real etcd server (tests/etcd_fixture.py) and real service processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pegaflow.devcluster import Proc

pytest_plugins = ["tests.etcd_fixture"]


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Service processes a test starts (append them): killed when it ends."""
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()
