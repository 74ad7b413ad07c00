"""The worker's layer-wise (synchronous) loads through the same-host shortcut, against a
real ``pegaflow-server``: saved by one worker, loaded by another during a "forward
pass" that waits for each layer, byte-identical; misses reported as load errors.

Runs on the CPU here and, where there is one, on a CUDA device too (then the copies are
the tile kernel reading the pinned pool, and each layer waits on its own event).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pegaflow.client import SyncPegaClient
from pegaflow.connector.loadcheck import DeferredLoadErrors
from pegaflow.connector.metadata import LoadJob, SaveJob, StepPlan
from pegaflow.connector.metrics import Counters
from pegaflow.connector.scheduler.side import SchedulerSide
from pegaflow.connector.settings import ConnectorSettings
from pegaflow.connector.worker.side import WorkerSide

from pegaflow.config import ClientConfig
from pegaflow.tools.devcluster import Proc, start_server
from tests.support.connector_fakes import FakeRequest, new_req, sched_output

pytestmark = pytest.mark.ucx

NS = "test-layerwise"
NB = 16
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    p = start_server(extra=["--node-pool-bytes", "64MiB", "--node-slab-bytes", "4MiB"])
    try:
        yield p
    finally:
        p.terminate()


def _kv(device: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {  # vLLM 0.26 FlashAttention per-layer layout (B, H, N, 2D)
        f"model.layers.{i}.self_attn.attn": torch.randn(NB, 2, 16, 64, generator=g)
        .to(torch.bfloat16)
        .to(device)
        for i in range(4)
    }


def _worker(
    server: Proc, kv: dict[str, torch.Tensor], defer: bool = False
) -> tuple[WorkerSide, Counters]:
    coord, node = server.ready["coordinator"], server.ready["node"]
    s = ConnectorSettings.load({"coordinators": coord, "local_node": node}, env={})
    c = Counters()
    w = WorkerSide(
        s, 0, c, lambda: SyncPegaClient(ClientConfig(coordinators=[coord])), defer_checks=defer
    )
    w.register_kv_caches(kv, NB)
    return w, c


def _save_blocks_1_to_3(w: WorkerSide, c: Counters, ns: str, hashes: list[bytes]) -> float:
    """Save KV blocks 1-3 under ``hashes[:3]``; the worker's stored-block count after
    waiting (up to 10 s) for the node to commit them."""
    w.submit_saves(StepPlan(ns, saves=[SaveJob("a", [1, 2, 3], hashes[:3])]))
    w.wait_for_copies(["a"])
    deadline = time.monotonic() + 60
    while c.totals().get("save_blocks", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    return c.totals().get("save_blocks", 0)


def _saved_pair(
    server: Proc, device: str, tag: str, seeds: tuple[int, int]
) -> tuple[str, list[bytes], dict[str, torch.Tensor], dict[str, torch.Tensor], Any, Any]:
    """Namespace ``NS-tag`` with blocks 1-3 saved by one worker, and a second worker
    (its checks deferred) to load them: ``(ns, hashes, src, dst, (w1, c1), (w2, c2))``."""
    ns = f"{NS}-{tag}"
    src, dst = _kv(device, seeds[0]), _kv(device, seeds[1])
    saver, loader = _worker(server, src), _worker(server, dst, defer=True)
    hashes = [tag.encode() + bytes([i]) * 15 for i in range(4)]
    try:
        assert _save_blocks_1_to_3(saver[0], saver[1], ns, hashes) == 3
    except BaseException:
        saver[0].shutdown()
        loader[0].shutdown()
        raise
    return ns, hashes, src, dst, saver, loader


def _forward(w: WorkerSide, kv: dict[str, torch.Tensor], device: str) -> tuple[set[int], Any]:
    """A "forward pass": wait for every layer's loads, then what the step reports
    (blocks that failed, the report for the scheduler), with the device caught up."""
    for name in kv:
        w.wait_layer(name)
    errors, report = w.take_load_errors(), w.take_report()
    if device == "cuda":
        torch.cuda.synchronize()
    return errors, report


@pytest.mark.parametrize("device", DEVICES)
def test_layer_wise_load_from_the_local_pool(server: Proc, device: str) -> None:
    node = server.ready["node"]
    src, dst = _kv(device, 1), _kv(device, 2)
    before = {k: v.clone() for k, v in dst.items()}
    w1, c1 = _worker(server, src)
    w2, c2 = _worker(server, dst)
    hashes = [device.encode() + bytes([i]) * 15 for i in range(4)]
    try:
        assert _save_blocks_1_to_3(w1, c1, NS, hashes) == 3

        # one step: the load is queued at its start; each layer waits for its blocks
        job = LoadJob("b", [9, 10, 11, 12], hashes, [[node]] * 4, sync=True)
        w2.start_step(StepPlan(NS, loads=[job]))
        errors, report = _forward(w2, dst, device)
        assert errors == {12}  # the 4th block was never stored: vLLM recomputes it
        assert report is not None and report.load_failed == {"b": 3}
        for name in src:
            assert torch.equal(dst[name][9:12].view(torch.int16), src[name][1:4].view(torch.int16))
            assert torch.equal(dst[name][:9], before[name][:9])
        t = c2.totals()
        assert t["layerwise_load_jobs"] == 1 and t["local_load_blocks"] == 3
        assert t["load_failed_blocks"] == 1
        # a layer-wise load is not an async one: nothing to report as received
        assert w2.get_finished(set()) == (None, None)
    finally:
        w1.shutdown()
        w2.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_scheduler_locates_so_the_worker_copies_at_once(server: Proc, device: str) -> None:
    """The scheduler locates (and pins) local hits while the coordinator answers its
    lookup; the worker copies from those locations with no round trip of its own, and
    falls back to its own locate when they are too old."""
    coord, node = server.ready["coordinator"], server.ready["node"]
    ns = f"{NS}-sched-{device}"
    src = _kv(device, 3)
    w1, c1 = _worker(server, src)
    req = FakeRequest("r1", list(range(4 * 16 + 1)), 16)
    hashes = req.block_hashes
    settings = ConnectorSettings.load({"coordinators": coord, "local_node": node}, env={})
    client = SyncPegaClient(ClientConfig(coordinators=[coord]))
    sched = SchedulerSide(settings, 16, 1, namespace=lambda: ns, counters=Counters(),
                          client=client)  # fmt: skip
    try:
        _save_blocks_1_to_3(w1, c1, ns, hashes)
        deadline = time.monotonic() + 60
        # the index learns of the blocks through etcd-less publishing: wait for a hit
        while time.monotonic() < deadline:
            if client.lookup(ns, hashes[:3]).hits == 3:
                break
            time.sleep(0.05)

        sched.warm_up()  # what the connector runs at engine start: connections made
        assert sched.get_num_new_matched_tokens(req, 0) == (48, False)  # layer-wise
        assert not sched.counters.totals().get("lookup_errors")
        sched.update_state_after_alloc(req, ([9, 10, 11, 12, 13],), 48)
        plan = sched.build_plan(sched_output(new=[new_req("r1", [9, 10, 11, 12, 13], 0)]))
        (job,) = plan.loads
        assert job.sync and len(job.located[0]) == 3 and job.pins[0] > 0

        for stale in (False, True):
            dst = _kv(device, 4)
            w2, c2 = _worker(server, dst)
            assert w2._local is not None
            w2._local.attach(w2._get_client())
            own_locates: list[int] = []
            real_locate = w2._local._locate

            def counting(*a: Any, real: Any = real_locate, seen: list[int] = own_locates) -> Any:
                seen.append(1)
                return real(*a)

            w2._local._locate = counting  # type: ignore[method-assign]
            if stale:
                job.located_at = time.monotonic() - 60
            try:
                w2.start_step(StepPlan(ns, loads=[job]))
                for name in dst:
                    w2.wait_layer(name)
                assert w2.take_load_errors() == set()
                if device == "cuda":
                    torch.cuda.synchronize()
                for name in src:
                    got = dst[name][9:12].view(torch.int16)
                    assert torch.equal(got, src[name][1:4].view(torch.int16))
                assert c2.totals()["local_load_blocks"] == 3
                assert own_locates == ([1] if stale else [])
            finally:
                w2.shutdown()
    finally:
        w1.shutdown()
        sched.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_steps_layer_wise_loads_are_queued_together(server: Proc, device: str) -> None:
    """The layer-wise loads of several requests in one step (a batch of hits) are queued
    at once, layer-major: on CUDA layer k of every load completes with one event, so the
    forward pass's layer k waits for k + 1 layers of everyone's blocks rather than for
    the earlier requests' whole prefixes.  Each load is still verified and accounted on
    its own."""
    node = server.ready["node"]
    ns = f"{NS}-batch-{device}"
    src, dst = _kv(device, 5), _kv(device, 6)
    w1, c1 = _worker(server, src)
    w2, c2 = _worker(server, dst)
    hashes = [device.encode() + b"b" + bytes([i]) * 12 for i in range(4)]
    try:
        assert _save_blocks_1_to_3(w1, c1, ns, hashes) == 3
        jobs = [
            LoadJob("x", [9, 10], hashes[:2], [[node]] * 2, sync=True),
            LoadJob("y", [13, 14], hashes[2:], [[node]] * 2, sync=True),  # 14: never stored
        ]
        w2.start_step(StepPlan(ns, loads=jobs))
        loads = [p for _, p, _ in w2._sync_loads]
        assert len(loads) == 2
        if device == "cuda":
            px, py = loads
            assert px.transfer.events and px.transfer.events == py.transfer.events
        errors, report = _forward(w2, dst, device)
        assert errors == {14}
        assert report is not None and report.load_failed == {"y": 1}
        for name in src:
            assert torch.equal(dst[name][9:11].view(torch.int16), src[name][1:3].view(torch.int16))
            assert torch.equal(dst[name][13].view(torch.int16), src[name][3].view(torch.int16))
        t = c2.totals()
        assert t["layerwise_load_jobs"] == 2 and t["local_load_blocks"] == 3
    finally:
        w1.shutdown()
        w2.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_a_steps_load_checks_wait_until_vllm_reads_them(server: Proc, device: str) -> None:
    """With the checks deferred (the worker in vLLM's scheduler process), a step's load
    errors are checked when first read, not at the end of the step: the next step's
    loads are queued meanwhile (a batch split over steps copies without a gap).  Read
    as vLLM reads it (``MultiConnector``'s ``agg |= x`` included), the answer is the
    same as an immediate check, and the report follows once it is checked."""
    node = server.ready["node"]
    ns = f"{NS}-deferred-{device}"
    src, dst = _kv(device, 7), _kv(device, 8)
    w1, c1 = _worker(server, src)
    w2, c2 = _worker(server, dst, defer=True)
    hashes = [device.encode() + b"d" + bytes([i]) * 12 for i in range(4)]
    try:
        assert _save_blocks_1_to_3(w1, c1, ns, hashes) == 3
        w2.start_step(
            StepPlan(ns, loads=[LoadJob("x", [13, 14], hashes[2:], [[node]] * 2, sync=True)])
        )
        for name in dst:
            w2.wait_layer(name)
        first = w2.take_load_errors()  # 14: never stored
        assert isinstance(first, DeferredLoadErrors) and not first.checked
        assert w2.take_report() is None  # nothing known before the check
        w2.start_step(
            StepPlan(ns, loads=[LoadJob("y", [9, 10], hashes[:2], [[node]] * 2, sync=True)])
        )
        second = w2.take_load_errors()
        agg: set[int] = set()
        agg |= first
        assert agg == {14} and first.checked and first.read_first_by_vllm
        assert 14 in first and list(first) == [14] and bool(second) is False
        report = w2.take_report()
        assert report is not None and report.load_failed == {"x": 1}
        if device == "cuda":
            torch.cuda.synchronize()
        for name in src:
            assert torch.equal(dst[name][13].view(torch.int16), src[name][3].view(torch.int16))
            assert torch.equal(dst[name][9:11].view(torch.int16), src[name][1:3].view(torch.int16))
        assert c2.totals()["local_load_blocks"] == 3
    finally:
        w1.shutdown()
        w2.shutdown()


def test_an_answer_vllm_never_reads_is_checked_and_deferring_stops(server: Proc) -> None:
    """A deferred answer still unread three steps on is checked by the worker (its pins
    go back), and the worker stops deferring: this vLLM does not read outputs the way
    the tested versions do."""
    node = server.ready["node"]
    ns, hashes, _src, _dst, (w1, _c1), (w2, _c2) = _saved_pair(server, "cpu", "u", (9, 10))
    try:
        w2.start_step(StepPlan(ns, loads=[LoadJob("x", [9], hashes[:1], [[node]], sync=True)]))
        unread = w2.take_load_errors()
        assert isinstance(unread, DeferredLoadErrors)
        for _ in range(3):
            assert w2.take_load_errors() == set()
        assert unread.checked and not unread.read_first_by_vllm and not w2.defer_checks
        assert set(unread) == set()
    finally:
        w1.shutdown()
        w2.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the early start is for GPUs")
def test_a_planned_steps_loads_start_before_the_step_and_are_taken_by_it(server: Proc) -> None:
    """In the scheduler's process a step's layer-wise loads are queued when the plan is
    built (:meth:`WorkerSide.prestart`); the step then takes them (it queues nothing)
    and its blocks arrive byte-identical.  Loads planned for a step vLLM did not run
    are checked with the next one, their pins given back."""
    node = server.ready["node"]
    ns, hashes, src, dst, (w1, _c1), (w2, c2) = _saved_pair(server, "cuda", "p", (11, 12))
    try:
        assert w2._local_ready.wait(30)  # the engine-start mapping of the node's pool
        plan = StepPlan(ns, loads=[LoadJob("x", [9, 10], hashes[:2], [[node]] * 2, sync=True)])
        w2.prestart(plan)
        assert [j for j, _p, _t in w2._early_loads] == plan.loads
        queued = c2.totals().get("layerwise_start_seconds", 0.0)
        w2.start_step(plan)
        assert w2._early_loads == []
        assert c2.totals().get("layerwise_start_seconds", 0.0) == queued  # nothing re-queued
        for name in dst:
            w2.wait_layer(name)
        assert bool(w2.take_load_errors()) is False
        other = StepPlan(ns, loads=[LoadJob("y", [13], hashes[2:3], [[node]], sync=True)])
        w2.prestart(other)  # planned, never run
        w2.start_step(StepPlan(ns))
        assert set(w2.take_load_errors()) == set()
        torch.cuda.synchronize()
        for name in src:
            assert torch.equal(dst[name][9:11].view(torch.int16), src[name][1:3].view(torch.int16))
            assert torch.equal(dst[name][13].view(torch.int16), src[name][3].view(torch.int16))
        assert c2.totals()["local_load_blocks"] == 3
    finally:
        w1.shutdown()
        w2.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the early start is for GPUs")
def test_with_cuda_graphs_each_load_starts_as_its_blocks_are_allocated(server: Proc) -> None:
    """Where vLLM replays CUDA graphs, each request's layer-wise load is queued the
    moment vLLM allocates its blocks (:meth:`WorkerSide.prestart_job`), before the
    scheduler looks up the step's next request; the step takes every such load of its
    plan and the blocks arrive byte-identical.  An eager worker leaves them to the plan."""
    node = server.ready["node"]
    ns, hashes, src, dst, (w1, _c1), (w2, c2) = _saved_pair(server, "cuda", "g", (15, 16))
    eager = w2.graph_tokens
    try:
        w2.graph_tokens = 512
        w2.start_step(StepPlan(ns))  # the engine's first step: its start-up work runs
        w2.take_load_errors()
        assert w2._local_ready.wait(30)
        jobs = [
            LoadJob("x", [9, 10], hashes[:2], [[node]] * 2, sync=True),
            LoadJob("y", [13], hashes[2:3], [[node]], sync=True),
        ]
        for job in jobs:
            w2.prestart_job(job, ns)
        assert [j for j, _p, _t in w2._early_loads] == jobs
        queued = c2.totals().get("layerwise_start_seconds", 0.0)
        plan = StepPlan(ns, loads=jobs, tokens=2)
        w2.start_step(plan)
        assert w2._early_loads == []
        assert c2.totals().get("layerwise_start_seconds", 0.0) == queued  # nothing re-queued
        for name in dst:
            w2.wait_layer(name)
        assert set(w2.take_load_errors()) == set()
        torch.cuda.synchronize()
        for name in src:
            assert torch.equal(dst[name][9:11].view(torch.int16), src[name][1:3].view(torch.int16))
            assert torch.equal(dst[name][13].view(torch.int16), src[name][3].view(torch.int16))
        w2.graph_tokens = 0
        w2.prestart_job(LoadJob("z", [14], hashes[:1], [[node]], sync=True), ns)
        assert w2._early_loads == []
    finally:
        w2.graph_tokens = eager
        w1.shutdown()
        w2.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA loads kernels lazily")
def test_a_step_of_a_new_size_queues_its_loads_a_few_layers_ahead(server: Proc) -> None:
    """In a step whose token count the engine has not run yet (a new shape: CUDA may load
    kernels for it, which waits for every copy in flight) only ``load_lookahead_layers``
    layers are queued before the forward pass, each later one as the forward pass waits
    for the layer that many before it; a later step of that size queues all at once.
    The blocks arrive byte-identical either way."""
    node = server.ready["node"]
    ns, hashes, src, dst, (w1, _c1), (w2, c2) = _saved_pair(server, "cuda", "a", (13, 14))
    names = list(dst)
    try:
        assert w2.settings.load_lookahead_layers == 2
        for step, (ids, ahead) in enumerate((([9, 10], 2), ([12, 13], 0))):
            job = LoadJob(f"r{step}", ids, hashes[:2], [[node]] * 2, sync=True)
            plan = StepPlan(ns, loads=[job], tokens=32)
            w2.start_step(plan)
            w2.begin_forward(plan)
            (xfer,) = [p.transfer for _, p, _ in w2._sync_loads]
            assert len(xfer.events) == (ahead or len(names))
            w2.wait_layer(names[0])
            assert len(xfer.events) == (min(ahead + 1, len(names)) if ahead else len(names))
            for name in names[1:]:
                w2.wait_layer(name)
            w2.end_forward()
            assert len(xfer.events) == len(names)
            assert bool(w2.take_load_errors()) is False
            torch.cuda.synchronize()
            for name in src:
                got = dst[name][ids[0] : ids[-1] + 1].view(torch.int16)
                assert torch.equal(got, src[name][1:3].view(torch.int16))
        assert c2.totals()["local_load_blocks"] == 4
    finally:
        w1.shutdown()
        w2.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies on a CUDA stream")
def test_a_loads_cost_is_its_copies_time_not_the_forward_passes(server: Proc) -> None:
    """The cost model learns what a layer-wise load costs from its copies' busy time on
    the device: a forward pass that asks for its layers slowly (one that also computes
    other requests' prompts, or waits for other engines on the GPU) does not make the
    load look slow, which would have the scheduler decline the hits that follow."""
    node = server.ready["node"]
    ns, hashes, _src, dst, (w1, _c1), (w2, _c2) = _saved_pair(server, "cuda", "b", (15, 16))
    try:
        for step, tokens in enumerate((32, 48)):  # two new sizes: layers queued as asked
            ids = [9 + 3 * step, 10 + 3 * step]
            plan = StepPlan(
                ns,
                loads=[LoadJob(f"r{step}", ids, hashes[:2], [[node]] * 2, sync=True)],
                tokens=tokens,
            )
            w2.start_step(plan)
            w2.begin_forward(plan)
            (pending,) = [p for _, p, _ in w2._sync_loads]
            for name in dst:
                time.sleep(0.05)
                w2.wait_layer(name)
            w2.end_forward()
            assert bool(w2.take_load_errors()) is False
            torch.cuda.synchronize()
        busy, span = pending.transfer.busy_s(), pending.transfer.device_ms()
        assert busy is not None and span is not None and 0 < busy * 1e3 <= span
        ((_source, size, seconds),) = w2.books.report.samples  # the first load's is dropped
        assert w2.io is not None and size == 2 * w2.io.block_bytes
        # the time to queue it and its copies' busy time, not the wait through the
        # forward pass (its layers were asked for 50 ms apart)
        assert seconds == pytest.approx(pending.queued_s + busy)
    finally:
        w1.shutdown()
        w2.shutdown()
