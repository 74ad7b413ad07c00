"""End to end through vLLM's OpenAI server: ``vllm serve`` started exactly as the README
documents it (the three ``--kv-transfer-config`` keys, the connector's settings from
``PEGAFLOW_*`` variables), a real ``pegaflow-server``, and a real HTTP client.

One ``pegaflow-server`` serves the module; ``vllm serve`` starts three times in file
order: a cold then a warm request; a restart (SIGTERM, a new process) whose first
request is a hit from PegaFlow with the same completion text; and vLLM's
``MultiConnector`` wrapping ``PegaKVConnector`` (registered through the
``vllm.general_plugins`` entry point), which serves, hits and saves.

The servers' tests are slow (each start takes 20-40 s): ``pytest -m slow
tests/e2e/test_serving_http.py``; the registration's own test is not.
"""

from __future__ import annotations

import importlib.util
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pegaflow.tools.devcluster import Proc, start_server
from tests.support.vllm_engine import (
    VllmServe,
    cached_tokens,
    text_prompt,
    tiny_model_with_tokenizer,
    wait_saved,
)

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

#: The README's ``--kv-transfer-config``, word for word.
THREE_KEYS = {
    "kv_connector": "PegaKVConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "pegaflow.connector",
}
#: PegaKVConnector inside vLLM's MultiConnector, named only by its registered name.
MULTI = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "PegaKVConnector", "kv_role": "kv_both"}]
    },
}
BS = 32
PROMPT = text_prompt(300, seed=14)  # 9 full blocks (288 tokens) and a partial one
PROMPT_BLOCKS = 300 // BS
OTHER = text_prompt(200, seed=15)  # 6 full blocks, first seen by the MultiConnector server


def pega(metrics: dict[str, float], counter: str) -> float:
    """The connector counter ``counter`` (a key of ``connector.metrics.COUNTERS``) as the
    engine's ``/metrics`` exports it (``vllm:pegaflow_...``)."""
    pat = re.compile(rf"^vllm:pegaflow_(?:connector_)?{counter}(?:_total)?$")
    found = [v for name, v in metrics.items() if pat.match(name)]
    assert found, f"/metrics has no vllm:pegaflow series for {counter!r}: " + ", ".join(
        sorted(n for n in metrics if "pegaflow" in n)
    )
    return sum(found)


def wait_metrics(
    srv: VllmServe, cond: Callable[[dict[str, float]], bool], timeout: float = 120.0
) -> dict[str, float]:
    """The server's ``/metrics`` once ``cond`` holds (connector counters reach vLLM's
    Prometheus with the engine steps after them); fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        if cond(m):
            return m
        if time.monotonic() > deadline:
            pega_series = {k: v for k, v in m.items() if "pegaflow" in k or "external" in k}
            pytest.fail(f"{srv.name}'s /metrics never satisfied the condition: {pega_series}")
        time.sleep(0.3)


def test_plugin_registers_the_connector_by_name() -> None:
    """The ``vllm.general_plugins`` entry point vLLM loads in its processes registers
    ``PegaKVConnector``: a config naming it without ``kv_connector_module_path`` (as a
    ``MultiConnector`` child does) resolves to the class; loading twice is harmless."""
    from importlib.metadata import entry_points

    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    plugins = {e.name: e for e in entry_points(group="vllm.general_plugins")}
    assert "pegaflow" in plugins, f"no pegaflow entry point among {sorted(plugins)}"
    register = plugins["pegaflow"].load()
    register()
    register()
    from pegaflow.connector import PegaKVConnector

    ktc = KVTransferConfig(kv_connector="PegaKVConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(ktc) is PegaKVConnector
    assert KVConnectorFactory.get_connector_class_by_name("PegaKVConnector") is PegaKVConnector


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    """One single-host ``pegaflow-server`` (small pool, free ports) for the module."""
    srv = start_server(extra=["--pool-size", "256MiB", "--node-slab-bytes", "16MiB"])
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serving")


@pytest.fixture(scope="module")
def serve(server: Proc, workdir: Path) -> Iterator[Callable[[str, dict[str, Any]], VllmServe]]:
    """Starts ``vllm serve`` against the module's ``pegaflow-server`` (its address and a
    stats file come from ``PEGAFLOW_*`` variables, as in production); every server
    still running at the end of the module is killed."""
    model = tiny_model_with_tokenizer(workdir / "model")
    running: list[VllmServe] = []

    def start(name: str, ktc: dict[str, Any]) -> VllmServe:
        env = {
            "PEGAFLOW_CLIENT_COORDINATORS": server.ready["coordinator"],
            "PEGAFLOW_CONNECTOR_STATS_PATH": str(workdir / name),
        }
        srv = VllmServe(model, ktc, env=env, extra=["--enable-prompt-tokens-details"], name=name)
        running.append(srv)
        return srv

    yield start
    for srv in running:
        srv.kill()


@pytest.fixture(scope="module")
def cold() -> dict[str, Any]:
    """The first server's cold answer to :data:`PROMPT`, for the later tests."""
    return {}


@pytest.mark.slow
@pytest.mark.vllm
def test_cold_then_warm(
    serve: Callable[[str, dict[str, Any]], VllmServe], cold: dict[str, Any], workdir: Path
) -> None:
    """A cold request computes and the connector saves its full blocks to PegaFlow; the
    same prompt again is a hit (vLLM's own cache), with the same text; the saves show
    on the engine's ``/metrics``."""
    srv = serve("s1", THREE_KEYS)
    r = srv.complete(PROMPT)
    assert r["usage"]["prompt_tokens"] == 300 and r["usage"]["completion_tokens"] == 8
    assert cached_tokens(r) == 0
    text = r["choices"][0]["text"]
    assert text
    cold["text"] = text
    saved = wait_saved(str(workdir / "s1"), PROMPT_BLOCKS)
    assert saved.get("save_blocks", 0) == PROMPT_BLOCKS, saved

    r = srv.complete(PROMPT)
    assert r["choices"][0]["text"] == text
    assert cached_tokens(r) == PROMPT_BLOCKS * BS
    m = wait_metrics(srv, lambda m: pega(m, "save_blocks") >= PROMPT_BLOCKS)
    assert pega(m, "lookup_miss_blocks") >= PROMPT_BLOCKS
    cold["server"] = srv


@pytest.mark.slow
@pytest.mark.vllm
def test_restart_hits_pegaflow(
    serve: Callable[[str, dict[str, Any]], VllmServe], cold: dict[str, Any]
) -> None:
    """SIGTERM the server, start a new ``vllm serve``: its vLLM cache is empty, so the
    same prompt's cached tokens all come from PegaFlow, and the text is the cold one."""
    if "server" not in cold:
        pytest.skip("needs test_cold_then_warm")
    old: VllmServe = cold.pop("server")
    rc = old.terminate()
    assert rc is not None, f"s1 did not exit on SIGTERM:\n{old.tail()}"

    srv = serve("s2", THREE_KEYS)
    r = srv.complete(PROMPT)
    assert r["choices"][0]["text"] == cold["text"]
    assert cached_tokens(r) == PROMPT_BLOCKS * BS
    m = wait_metrics(
        srv,
        lambda m: pega(m, "load_blocks") + pega(m, "local_load_blocks") >= PROMPT_BLOCKS,
    )
    assert pega(m, "lookup_hit_blocks") >= PROMPT_BLOCKS
    assert pega(m, "load_failed_blocks") == 0
    assert m["vllm:external_prefix_cache_hits_total"] >= PROMPT_BLOCKS * BS
    assert srv.terminate() is not None, srv.tail()


@pytest.mark.slow
@pytest.mark.vllm
def test_multiconnector_serves_and_hits(
    serve: Callable[[str, dict[str, Any]], VllmServe], cold: dict[str, Any], workdir: Path
) -> None:
    """``MultiConnector`` wrapping ``PegaKVConnector`` by its registered name (no module
    path): the server starts, loads PegaFlow's blocks (same text as the cold answer),
    saves a new prompt's blocks, and exports the connector's counters."""
    if "text" not in cold:
        pytest.skip("needs test_cold_then_warm")
    srv = serve("s3", MULTI)
    r = srv.complete(PROMPT)
    assert r["choices"][0]["text"] == cold["text"]
    assert cached_tokens(r) == PROMPT_BLOCKS * BS

    r = srv.complete(OTHER)
    assert cached_tokens(r) == 0
    saved = wait_saved(str(workdir / "s3"), 200 // BS)
    assert saved.get("save_blocks", 0) == 200 // BS, saved
    m = wait_metrics(srv, lambda m: pega(m, "lookup_hit_blocks") >= PROMPT_BLOCKS)
    assert pega(m, "load_failed_blocks") == 0
    assert srv.terminate() is not None, srv.tail()
