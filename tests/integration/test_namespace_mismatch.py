"""A namespace mismatch is logged as such (issue 35, defect 6): an engine that finds
nothing while the same model is stored under another namespace says which one, and in
which factor the engines differ.

Against a real ``pegaflow-server``: blocks are stored under one namespace of a model by
a real client, then a scheduler side whose namespace differs in its block size looks a
request up, finds nothing, and asks the coordinator (``namespace_peers``).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from pegaflow.client import SyncPegaClient
from pegaflow.connector.metrics import Counters
from pegaflow.connector.scheduler.nsdiag import differences, mismatch_line
from pegaflow.connector.scheduler.side import SchedulerSide
from pegaflow.connector.settings import ConnectorSettings

from pegaflow.config import ClientConfig
from pegaflow.errors import BadRequest
from pegaflow.tools.devcluster import Proc
from tests.support.connector_fakes import FakeRequest

pytestmark = pytest.mark.ucx

BS = 4
STORED = "llama.00aa"
ASKING = "llama.00bb"
FACTORS = {"model": "config:abc", "dtype": "bfloat16", "block_size": "32", "tp_size": "1"}


def _client(coordinator: str) -> SyncPegaClient:
    return SyncPegaClient(ClientConfig(coordinators=[coordinator], lookup_timeout_s=2.0))


def test_differences_name_each_factor_with_both_values() -> None:
    mine = {**FACTORS, "block_size": "16"}
    assert differences(mine, FACTORS) == ["block_size (16 here, 32 there)"]
    assert differences(FACTORS, FACTORS) == []
    line = mismatch_line(ASKING, mine, [{"ns": STORED, "blocks": 3, "factors": {}}])
    assert "did not send their factors" in line and STORED in line


def test_an_engine_that_finds_nothing_names_the_namespace_and_the_factor(
    server: Proc, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator = server.ready["coordinator"]
    c = _client(coordinator)
    try:
        # the engine that stored the model sent its factors when its first lookup missed
        assert c.namespace_peers(STORED, FACTORS) == []
        blocks = [bytes([i]) * 32 for i in range(1, 4)]
        out = c.put_blocks(STORED, [(h, 0, np.full(4096, 7, np.uint8)) for h in blocks])
        assert out.stored == 3
        # another namespace of another model's label is no peer
        assert c.namespace_peers("mistral.00cc", FACTORS) == []
    finally:
        c.close()

    caplog.set_level(logging.WARNING, "pegaflow.connector")
    mine = {**FACTORS, "block_size": "16"}
    settings = ConnectorSettings.load({"coordinators": coordinator}, env={})
    side = SchedulerSide(
        settings, BS, 1, namespace=lambda: ASKING, counters=Counters(),
        client_factory=lambda: _client(coordinator), factors=lambda: mine,
    )  # fmt: skip
    try:
        req = FakeRequest("r1", list(range(4 * BS)), BS)
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        deadline = time.monotonic() + 60
        while "namespace mismatch" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)  # the ask runs in the background
        line = caplog.text
        assert "namespace mismatch" in line, line
        assert f"nothing of this engine's namespace {ASKING} is stored" in line
        assert f"{STORED} (3 blocks; it differs in block_size (16 here, 32 there))" in line
        # said once: a later miss asks nothing more
        side.get_num_new_matched_tokens(FakeRequest("r2", list(range(9 * BS)), BS), 0)
        time.sleep(0.2)
        assert caplog.text.count("namespace mismatch") == 1
    finally:
        side.close()


def test_a_malformed_namespace_is_a_typed_error(server: Proc) -> None:
    c = _client(server.ready["coordinator"])
    try:
        with pytest.raises(BadRequest, match="namespace"):
            c.namespace_peers("bad namespace!", FACTORS)
    finally:
        c.close()
