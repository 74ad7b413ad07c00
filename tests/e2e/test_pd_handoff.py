"""Prefill/decode roles and the handoff through vLLM's ``kv_transfer_params``.

Unit tests of the params codec and of the scheduler side's roles and handoff waits
(pure logic: fake requests, an in-memory fake cluster, an injected clock); then one
slow end-to-end test with two real ``vllm serve`` CPU replicas, a producer and a
consumer, against one real ``pegaflow-server``: ``pytest -m slow tests/e2e/test_pd_handoff.py``.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pegaflow.connector.handoff import KEY, MAX_BLOCKS, POLL_S, VERSION, Handoff
from pegaflow.connector.metrics import Counters
from pegaflow.connector.scheduler.side import SchedulerSide
from pegaflow.connector.settings import ConnectorSettings

from pegaflow.errors import BadRequest, PegaError, TooLarge
from tests.support.connector_fakes import Clock, FakeCluster, FakeRequest, new_req, sched_output

pytestmark = pytest.mark.ucx

BS = 4
NS = "tiny.abc"
FUTURE_MS = int(time.time() * 1000) + 3_600_000


def make(
    kv_role: str, cluster: FakeCluster | None = None, clock: Clock | None = None, **settings: Any
) -> tuple[SchedulerSide, FakeCluster, Counters, Clock]:
    cluster = cluster or FakeCluster()
    clock = clock or Clock()
    s = ConnectorSettings.load({"cost_model": False, **settings}, env={}, kv_role=kv_role)
    c = Counters()
    side = SchedulerSide(s, BS, 1, namespace=lambda: NS, counters=c, client=cluster, clock=clock)
    return side, cluster, c, clock


def store(cluster: FakeCluster, req: FakeRequest, n: int, node: str = "n1") -> None:
    for h in req.block_hashes[:n]:
        cluster.blocks[(NS, h, 0)] = (node, b"x")


def toks(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def handoff_of(req: FakeRequest, blocks: int, **over: Any) -> dict[str, Any]:
    h = Handoff(NS, blocks, req.block_hashes[blocks - 1], "n1", FUTURE_MS).to_params()
    h[KEY].update(over)
    return h


# ---- the params codec ------------------------------------------------------------------


def test_codec_round_trip_is_json_with_the_documented_keys() -> None:
    import json

    h = Handoff("tiny.abc", 9, bytes(range(32)), "host-a", 1234)
    params = json.loads(json.dumps(h.to_params()))
    assert params == {
        "pegaflow": {
            "v": VERSION,
            "namespace": "tiny.abc",
            "blocks": 9,
            "last_hash": bytes(range(32)).hex(),
            "node": "host-a",
            "expires_ms": 1234,
        }
    }
    assert Handoff.from_params(params) == h
    assert h.expired(1234) and not h.expired(1233)


def test_codec_absent_is_none_and_other_connectors_keys_are_ignored() -> None:
    assert Handoff.from_params(None) is None
    assert Handoff.from_params({}) is None
    assert Handoff.from_params({"do_remote_prefill": True}) is None
    assert Handoff.from_params("not a map") is None
    h = Handoff("tiny.abc", 1, b"\x01", "", 5)
    assert Handoff.from_params({**h.to_params(), "remote_engine_id": "x"}) == h


@pytest.mark.parametrize(
    "over, err",
    [
        ({"v": 2}, BadRequest),
        ({"v": None}, BadRequest),
        ({"namespace": ""}, BadRequest),
        ({"namespace": "a b"}, BadRequest),
        ({"namespace": 7}, BadRequest),
        ({"blocks": 0}, BadRequest),
        ({"blocks": -1}, BadRequest),
        ({"blocks": MAX_BLOCKS + 1}, BadRequest),
        ({"blocks": "3"}, BadRequest),
        ({"blocks": True}, BadRequest),
        ({"last_hash": "zz"}, BadRequest),
        ({"last_hash": ""}, BadRequest),
        ({"last_hash": "ab" * 65}, TooLarge),
        ({"last_hash": 12}, BadRequest),
        ({"node": None}, BadRequest),
        ({"node": "n" * 257}, TooLarge),
        ({"expires_ms": "soon"}, BadRequest),
        ({"expires_ms": -5}, BadRequest),
    ],
)
def test_codec_rejects_bad_fields_with_a_typed_error(over: dict[str, Any], err: type) -> None:
    params = Handoff("tiny.abc", 3, b"\xab" * 32, "n1", 99).to_params()
    params[KEY].update(over)
    with pytest.raises(err):
        Handoff.from_params(params)


def test_codec_rejects_a_non_map_entry_and_missing_fields() -> None:
    for bad in ([1, 2], "x", 5):
        with pytest.raises(BadRequest):
            Handoff.from_params({KEY: bad})
    for field in ("namespace", "blocks", "last_hash", "node", "expires_ms"):
        params = Handoff("tiny.abc", 3, b"\xab" * 32, "n1", 99).to_params()
        del params[KEY][field]
        with pytest.raises(PegaError):
            Handoff.from_params(params)


# ---- roles -----------------------------------------------------------------------------


def test_settings_take_the_role_from_vllm_not_from_the_extra_config() -> None:
    assert ConnectorSettings.load({}, env={}).kv_role == "kv_both"
    p = ConnectorSettings.load({}, env={}, kv_role="kv_producer")
    assert p.can_save and not p.can_load and p.hands_off
    c = ConnectorSettings.load({}, env={}, kv_role="kv_consumer")
    assert c.can_load and not c.can_save and not c.hands_off
    c = ConnectorSettings.load({"save_decode_blocks": True}, env={}, kv_role="kv_consumer")
    assert c.can_save and not c.saves_prompt
    b = ConnectorSettings.load({}, env={}, kv_role="kv_both")
    assert b.can_load and b.can_save and b.saves_prompt and not b.hands_off
    assert "kv_role" not in ConnectorSettings.keys()
    with pytest.raises(ValueError, match="unknown"):
        ConnectorSettings.load({"kv_role": "kv_producer"}, env={})
    with pytest.raises(ValueError, match="kv_role"):
        ConnectorSettings.load({}, env={}, kv_role="kv_sideways")
    with pytest.raises(ValueError, match="handoff_wait_s"):
        ConnectorSettings.load({"handoff_wait_s": -1}, env={})


def test_producer_saves_never_looks_up_and_returns_its_handoff() -> None:
    side, cl, _c, _ = make("kv_producer")
    req = FakeRequest("r", toks(14), BS)  # 3 full blocks + 2 tokens
    store(cl, req, 3)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert cl.lookups == 0
    plan = side.build_plan(sched_output(new=[new_req("r", [1, 2, 3, 4], 0)], scheduled={"r": 14}))
    assert [s.block_ids for s in plan.saves] == [[1, 2, 3]]
    assert side.request_finished(req) is True
    params = side.handoff_params(req)
    h = Handoff.from_params(params)
    assert h is not None
    assert (h.namespace, h.blocks, h.last_hash) == (NS, 3, req.block_hashes[2])
    assert h.expires_ms > time.time() * 1000 + 50_000  # handoff_ttl_s, 60 s by default


def test_producer_hands_off_known_blocks_too_and_nothing_for_a_short_prompt() -> None:
    side, _cl, _c, _ = make("kv_producer")
    a = FakeRequest("a", toks(9), BS)
    side.get_num_new_matched_tokens(a, 0)
    side.build_plan(sched_output(new=[new_req("a", [1, 2, 3], 0)], scheduled={"a": 9}))
    b = FakeRequest("b", toks(9), BS)  # same prompt: its blocks are known, not saved again
    side.get_num_new_matched_tokens(b, 0)
    plan = side.build_plan(sched_output(new=[new_req("b", [4, 5, 6], 0)], scheduled={"b": 9}))
    assert plan.saves == []
    h = Handoff.from_params(side.handoff_params(b))
    assert h is not None and h.blocks == 2
    short = FakeRequest("s", toks(3), BS)
    side.get_num_new_matched_tokens(short, 0)
    side.build_plan(sched_output(new=[new_req("s", [7], 0)], scheduled={"s": 3}))
    assert side.handoff_params(short) is None
    both, _, _, _ = make("kv_both")
    r = FakeRequest("r", toks(9), BS)
    both.get_num_new_matched_tokens(r, 0)
    both.build_plan(sched_output(new=[new_req("r", [1, 2, 3], 0)], scheduled={"r": 9}))
    assert both.handoff_params(r) is None


def test_consumer_saves_nothing_or_only_its_decode_blocks() -> None:
    for enabled, expect in ((False, []), (True, [[3]])):
        side, _, _, _ = make("kv_consumer", save_decode_blocks=enabled)
        req = FakeRequest("r", toks(8), BS)
        side.get_num_new_matched_tokens(req, 0)
        p = side.build_plan(sched_output(new=[new_req("r", [1, 2], 0)], scheduled={"r": 8}))
        assert p.saves == []  # prompt blocks: the producer's
        req.append(4)
        p = side.build_plan(sched_output(cached=[("r", [3], 11)], scheduled={"r": 1}))
        assert [s.block_ids for s in p.saves] == expect


# ---- the consumer's handoff ------------------------------------------------------------


def test_consumer_waits_for_blocks_in_flight_then_loads_exactly_them() -> None:
    side, cl, c, clock = make("kv_consumer")
    req = FakeRequest("r", toks(18), BS)  # 4 full blocks + 2 tokens
    req.kv_transfer_params = handoff_of(req, 4)
    store(cl, req, 1)  # the producer's commits are still landing
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    n = cl.lookups
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # within POLL_S: no RPC
    assert cl.lookups == n
    clock.t += POLL_S
    store(cl, req, 3)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    clock.t += POLL_S
    store(cl, req, 4)
    assert side.get_num_new_matched_tokens(req, 0) == (16, True)
    side.update_state_after_alloc(req, ([10, 11, 12, 13, 14],), 16)
    (job,) = side.build_plan(sched_output()).loads
    assert job.block_ids == [10, 11, 12, 13] and job.hashes == req.block_hashes[:4]
    assert c.totals()["handoffs"] == 1


def test_consumer_waiting_on_its_own_hosts_node_releases_each_polls_pins() -> None:
    """Blocks on the node of the consumer's host: each poll's locate pins what it found;
    a poll that comes up short unpins them; the full hit loads layer-wise."""
    side, cl, _c, clock = make("kv_consumer", local_node="n1")
    unpinned: list[int] = []
    real_unpin = cl.submit_unpin

    def unpin(node: str, pin: int, timeout: Any = None) -> Any:
        unpinned.append(pin)
        return real_unpin(node, pin, timeout)

    cl.submit_unpin = unpin  # type: ignore[method-assign]
    req = FakeRequest("r", toks(18), BS)
    req.kv_transfer_params = handoff_of(req, 4)
    store(cl, req, 2)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(unpinned) == 1
    clock.t += POLL_S
    store(cl, req, 4)
    assert side.get_num_new_matched_tokens(req, 0) == (16, False)  # layer-wise, same host
    side.update_state_after_alloc(req, ([10, 11, 12, 13, 14],), 16)
    (job,) = side.build_plan(sched_output()).loads
    assert job.sync and job.block_ids == [10, 11, 12, 13] and job.located
    assert len(unpinned) == 1


def test_consumer_loads_what_is_stored_once_the_wait_is_over() -> None:
    side, cl, c, clock = make("kv_consumer", handoff_wait_s=0.5)
    req = FakeRequest("r", toks(18), BS)
    req.kv_transfer_params = handoff_of(req, 4)
    store(cl, req, 2)
    while (got := side.get_num_new_matched_tokens(req, 0)) == (None, False):
        clock.t += POLL_S
        assert clock.t < 1000.0 + 0.5 + 2 * POLL_S, "waited past handoff_wait_s"
    assert got == (8, True)
    assert c.totals()["handoff_short"] == 1
    # nothing stored at all: a recompute after the wait
    side, cl, c, clock = make("kv_consumer", handoff_wait_s=0.1)
    req = FakeRequest("q", toks(18), BS)
    req.kv_transfer_params = handoff_of(req, 4)
    while (got := side.get_num_new_matched_tokens(req, 0)) == (None, False):
        clock.t += POLL_S
    assert got == (0, False)


def test_consumer_does_not_wait_for_what_vllm_computes_anyway() -> None:
    """The prompt's last token is always computed: a handoff naming every full block of
    a block-aligned prompt is whole once all but the last block are there."""
    side, cl, _c, _ = make("kv_consumer")
    req = FakeRequest("r", toks(16), BS)  # exactly 4 blocks
    req.kv_transfer_params = handoff_of(req, 4)
    store(cl, req, 3)
    assert side.get_num_new_matched_tokens(req, 0) == (12, True)


def test_consumer_with_a_cluster_down_does_not_wait() -> None:
    """Failed lookups are tried again at the next poll, until the lookups' breaker opens:
    then the consumer stops waiting and computes (a cluster down costs a few polls, not
    ``handoff_wait_s``)."""
    side, cl, _c, clock = make("kv_consumer")
    req = FakeRequest("r", toks(18), BS)
    req.kv_transfer_params = handoff_of(req, 4)
    cl.lookup_error = ConnectionError("down")
    answers = []
    for _ in range(side.settings.failures_to_backoff + 1):
        answers.append(side.get_num_new_matched_tokens(req, 0))
        if answers[-1] != (None, False):
            break
        clock.t += POLL_S
    assert answers[-1] == (0, False)
    assert len(answers) <= side.settings.failures_to_backoff + 1


def test_consumer_retries_a_failed_lookup_within_its_wait() -> None:
    """One lookup that fails (a deadline missed on a loaded host) does not end the wait:
    the next poll finds the blocks and the consumer loads them."""
    side, cl, _c, clock = make("kv_consumer")
    req = FakeRequest("r", toks(18), BS)
    req.kv_transfer_params = handoff_of(req, 4)
    store(cl, req, 4)
    cl.lookup_error = ConnectionError("a timeout")
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    cl.lookup_error = None
    clock.t += POLL_S
    assert side.get_num_new_matched_tokens(req, 0) == (16, True)


@pytest.mark.parametrize(
    "why, params",
    [
        ("malformed", {KEY: {"v": 1, "blocks": "many"}}),
        ("version", {KEY: {"v": 99}}),
        ("namespace", "other.ns"),
        ("hash", "wrong"),
        ("expired", "expired"),
        ("too many blocks", "long"),
    ],
)
def test_consumer_with_unusable_params_warns_and_recomputes(
    why: str, params: Any, caplog: pytest.LogCaptureFixture
) -> None:
    side, cl, c, _clock = make("kv_consumer")
    req = FakeRequest("r", toks(18), BS)
    if params == "other.ns":
        params = handoff_of(req, 4, namespace="other.ns")
    elif params == "wrong":
        params = handoff_of(req, 4, last_hash=(b"\x01" * 32).hex())
    elif params == "expired":
        params = handoff_of(req, 4, expires_ms=1)
    elif params == "long":
        params = handoff_of(req, 4)
        params[KEY]["blocks"] = 9
    req.kv_transfer_params = params
    with caplog.at_level(logging.WARNING, logger="pegaflow.connector"):
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # no wait: a miss
    assert any("handoff" in r.getMessage() and "recomput" in r.getMessage() for r in caplog.records)
    assert c.totals()["handoff_rejected"] == 1
    # an unusable handoff still gets the ordinary lookup: what is stored loads
    store(cl, req, 4)
    req2 = FakeRequest("r2", toks(18), BS)
    req2.kv_transfer_params = req.kv_transfer_params
    assert side.get_num_new_matched_tokens(req2, 0) == (16, True)


def test_consumer_without_params_looks_up_as_usual() -> None:
    side, cl, _c, _ = make("kv_consumer")
    req = FakeRequest("r", toks(18), BS)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    store(cl, req, 4)
    req = FakeRequest("r2", toks(18), BS)
    assert side.get_num_new_matched_tokens(req, 0) == (16, True)


# ---- end to end: two real `vllm serve` replicas, producer and consumer ---------------

E2E_BS = 32
E2E_PROMPT_TOKENS = 300  # 9 full blocks (288 tokens) and a partial one
E2E_BLOCKS = E2E_PROMPT_TOKENS // E2E_BS


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """One ``POST`` of JSON to a replica; the decoded answer (an HTTP error raises)."""
    import json
    import urllib.request

    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(json.loads(r.read()))


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A ``pegaflow-server`` and two ``vllm serve`` replicas of the tiny model against it:
    a ``kv_producer`` and a ``kv_consumer``."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM not installed")
    from pegaflow.tools.devcluster import start_server
    from tests.support.vllm_engine import VllmServe, tiny_model_with_tokenizer

    work: Path = tmp_path_factory.mktemp("pd")
    model = tiny_model_with_tokenizer(work / "model")
    server = start_server(extra=["--pool-size", "256MiB", "--node-slab-bytes", "16MiB"])
    running: list[VllmServe] = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            ktc = {
                "kv_connector": "PegaKVConnector",
                "kv_role": role,
                "kv_connector_module_path": "pegaflow.connector",
                "kv_load_failure_policy": "recompute",
                # generous on a loaded 2-core test machine; the default is 2 s
                "kv_connector_extra_config": {"handoff_wait_s": 10.0},
            }
            env = {
                "PEGAFLOW_CLIENT_COORDINATORS": server.ready["coordinator"],
                "PEGAFLOW_CONNECTOR_STATS_PATH": str(work / role),
            }
            running.append(
                VllmServe(model, ktc, env=env, extra=["--enable-prompt-tokens-details"], name=role)
            )
        yield {"producer": running[0], "consumer": running[1], "work": work}
    finally:
        for srv in running:
            srv.kill()
        server.terminate()


@pytest.mark.slow
@pytest.mark.vllm
def test_pd_handoff_through_vllm_serve(pd_pair: dict[str, Any]) -> None:
    """The producer prefills (``max_tokens=1``) and returns its handoff in the completion's
    ``kv_transfer_params``; the consumer, given them unchanged, loads every full prompt
    block (it computes only the partial last one) and answers token for token what a
    cold engine answers; the producer never looked up, the consumer saved nothing."""
    from tests.support.vllm_engine import cached_tokens, connector_stats, text_prompt

    producer, consumer, work = pd_pair["producer"], pd_pair["consumer"], pd_pair["work"]
    prompt = text_prompt(E2E_PROMPT_TOKENS, seed=21)
    body = {
        "model": producer.model,
        "prompt": prompt,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    pre = _post(producer.url + "/v1/completions", {**body, "max_tokens": 1})
    params = pre.get("kv_transfer_params")
    h = Handoff.from_params(params)
    assert h is not None, f"no PegaFlow handoff in the producer's answer: {pre}"
    assert h.blocks == E2E_BLOCKS and h.node

    out = _post(
        consumer.url + "/v1/completions",
        {**body, "max_tokens": 8, "kv_transfer_params": params},
    )
    # a cold single engine: the producer itself, with a cache salt no block shares
    cold = _post(producer.url + "/v1/completions", {**body, "max_tokens": 8, "cache_salt": "cold"})
    assert cached_tokens(cold) == 0
    assert out["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert out["choices"][0]["text"] == cold["choices"][0]["text"]
    # computed only the last, partial block
    assert cached_tokens(out) == E2E_BLOCKS * E2E_BS, consumer.tail(40)

    cons = connector_stats(str(work / "kv_consumer"))
    prod = connector_stats(str(work / "kv_producer"))
    assert cons.get("handoffs") == 1 and not cons.get("handoff_rejected"), cons
    assert not cons.get("handoff_short") and not cons.get("load_failed_blocks"), cons
    assert not cons.get("save_planned_blocks"), cons
    assert not prod.get("lookups") and not prod.get("lookups_local"), prod
    assert not prod.get("hit_tokens"), prod
