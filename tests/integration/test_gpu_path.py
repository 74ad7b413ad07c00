"""The connector's GPU data path (needs a CUDA device; skipped elsewhere).

KV caches shaped as vLLM 0.26 allocates them on a GPU, the real connector code
(``KVBlockIO`` + ``LocalPath``) and a real ``pegaflow-server``: save blocks, load them
back into different block ids, byte-identical; with the tile kernel reading the pinned
pool and with the copy-engine (DMA) path; per-layer and cross-layer layouts.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from pegaflow.client import SyncPegaClient
from pegaflow.connector.media.hostpool import relax_capture_mode
from pegaflow.connector.media.kvio import KVBlockIO
from pegaflow.connector.media.localpath import LoadRequest, LocalPath, PendingLoad

from pegaflow.config import ClientConfig
from pegaflow.tools.devcluster import Proc, start_server

pytestmark = [
    pytest.mark.ucx, pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    p = start_server(extra=["--node-pool-bytes", "512MiB", "--node-slab-bytes", "16MiB"])
    try:
        yield p
    finally:
        p.terminate()


def _caches(layout: str, blocks: int, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    layers, heads, tokens, head = 4, 8, 16, 128
    if layout == "cross_layer":  # (blocks, layers, tokens, heads, 2*head)
        t = torch.randn(blocks, layers, tokens, heads, 2 * head, device="cuda").bfloat16()
        return {"cross_layers": t}
    if layout == "mla":  # (blocks, tokens, 576): one latent vector per token
        return {f"layers.{i}.attn": torch.randn(blocks, tokens, 576, device="cuda").bfloat16()
                for i in range(layers)}  # fmt: skip
    out = {}
    for i in range(layers):  # FlashAttention NHD: physical (B, N, H, 2D), logical (B, H, N, 2D)
        raw = torch.randn(blocks, tokens, heads, 2 * head, device="cuda").bfloat16()
        out[f"model.layers.{i}.self_attn.attn"] = raw.permute(0, 2, 1, 3)
    return out


@contextlib.contextmanager
def _pair(
    server: Proc, layout: str, seed: int
) -> Iterator[tuple[SyncPegaClient, dict, dict, LocalPath, LocalPath]]:
    """A client, a source and a destination KV cache (96 blocks of ``layout``), and a
    writer and a reader of the server's pool through them, attached and pinned."""
    node = server.ready["node"]
    client = SyncPegaClient(ClientConfig(coordinators=[server.ready["coordinator"]]))
    src_kv, dst_kv = _caches(layout, 96, seed), _caches(layout, 96, seed + 1)
    writer = LocalPath(KVBlockIO(src_kv, 96), node, 10.0)
    reader = LocalPath(KVBlockIO(dst_kv, 96), node, 10.0)
    try:
        assert writer.attach(client) and reader.attach(client)
        for path in (writer, reader):
            assert path.pool is not None and path.pool.wait_registered(60)
        yield client, src_kv, dst_kv, writer, reader
    finally:
        writer.close()
        reader.close()
        client.close()


@pytest.mark.parametrize("layout", ["per_layer", "cross_layer", "mla"])
@pytest.mark.parametrize("mode", ["kernel", "dma2d", "dma"])
def test_gpu_save_then_load_into_other_blocks(server: Proc, layout: str, mode: str) -> None:
    with _pair(server, layout, 1) as (client, src_kv, dst_kv, writer, reader):
        src, dst = writer.io, reader.io
        for path in (writer, reader):
            path.copy_mode = mode
        assert src.kernel_ok
        ns = f"gpu-{layout}-{mode}"
        hashes = [bytes([i]) * 16 for i in range(70)]  # > one device staging chunk
        ids = list(range(5, 75))
        out = writer.save(client, ns, hashes, 0, ids).result(30)
        assert (out.stored, out.failed) == (70, 0)
        # other ids, reversed (runs of one block), then consecutive (long runs)
        for targets in ([95 - i for i in range(70)], list(range(10, 80))):
            for t in dst_kv.values():
                t.zero_()
            pending = reader.start_load(client, ns, hashes, 0, targets)
            ok = pending.finish()
            assert ok == [True] * 70
            for name in src_kv:
                want = src_kv[name][ids]
                got = dst_kv[name][targets]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
            # per-layer events exist for layer-wise waiting
            assert len(pending.transfer.events) == len(dst.layers)


def test_gpu_loads_queued_together_go_layer_major(server: Proc) -> None:
    """:meth:`KVBlockIO.copy_in_many` of two loads, one with long runs (2-D copies) and
    one with runs of one block (the tile kernel), byte-identical, with their digests,
    and one event per layer shared by both."""
    with _pair(server, "per_layer", 3) as (client, src_kv, dst_kv, writer, reader):
        dst = reader.io
        ns = "gpu-layer-major"
        hashes = [bytes([i, 7]) * 8 for i in range(40)]
        ids = list(range(5, 45))
        assert writer.save(client, ns, hashes, 0, ids).result(30).stored == 40
        long_runs, singles = list(range(50, 70)), [95 - i for i in range(20)]
        first, second = reader.start_loads(
            client,
            ns,
            [LoadRequest(hashes[:20], 0, long_runs), LoadRequest(hashes[20:], 0, singles)],
        )
        assert isinstance(first, PendingLoad) and isinstance(second, PendingLoad)
        assert first.transfer.events == second.transfer.events
        assert len(first.transfer.events) == len(dst.layers)
        assert first.finish() == [True] * 20 and second.finish() == [True] * 20
        for name in src_kv:
            got = dst_kv[name][long_runs + singles].view(torch.int16)
            assert torch.equal(got, src_kv[name][ids].view(torch.int16)), name


def test_gpu_checks_do_not_wait_for_work_queued_after_them(server: Proc) -> None:
    """A save's digests and a load's check are read on a stream of their own: a
    kernel queued later on the caller's stream (the next step's forward pass, under
    vLLM's asynchronous scheduling) is still running when both have returned."""
    with _pair(server, "per_layer", 5) as (client, src_kv, dst_kv, writer, reader):
        ns = "gpu-readback"
        hashes = [bytes([i, 9]) * 8 for i in range(16)]
        pending = None
        try:
            torch.cuda.synchronize()
            torch.cuda._sleep(8_000_000_000)  # seconds on the current stream
            busy = torch.cuda.Event()
            busy.record()
            assert writer.save(client, ns, hashes, 0, list(range(16))).result(30).stored == 16
            pending = reader.start_load(client, ns, hashes, 0, list(range(40, 56)))
            assert pending.finish() == [True] * 16
            assert not busy.query(), "the checks waited for the caller's stream"
        finally:
            torch.cuda.synchronize()
        for name in src_kv:
            got = dst_kv[name][40:56].view(torch.int16)
            assert torch.equal(got, src_kv[name][:16].view(torch.int16)), name


def test_gpu_loads_while_the_pool_is_partly_pinned_are_exact(server: Proc) -> None:
    """Loads whose blocks lie in pinned and in not yet pinned pieces (an engine's first
    requests while its pool is being pinned): the load pins the pieces it needs, then
    takes the fast path; every block byte-identical and checked; a load that pinned
    teaches the cost model nothing.  Then, pinning given up (a failed registration),
    loads copy the pageable way, exact too."""
    with _pair(server, "per_layer", 7) as (client, src_kv, dst_kv, writer, reader):
        ns = "gpu-partly-pinned"
        hashes = [bytes([i, 7]) * 8 for i in range(70)]
        ids = list(range(5, 75))
        assert writer.save(client, ns, hashes, 0, ids).result(30).stored == 70
        pool = reader.pool
        assert pool is not None and pool.pinner is not None
        pinner = pool.pinner
        pieces = len(pinner._pinned)

        def load_exact(tag: object) -> PendingLoad:
            for t in dst_kv.values():
                t.zero_()
            pending = reader.start_load(client, ns, hashes, 0, list(range(10, 80)))
            assert pending.finish() == [True] * 70
            for name in src_kv:
                got = dst_kv[name][10:80].view(torch.int16)
                assert torch.equal(got, src_kv[name][ids].view(torch.int16)), (name, tag)
            return pending

        pinner.done.clear()  # as while the pinning thread still runs
        for only in [None, *range(pieces)]:  # none pinned, then each piece alone
            pinner.release()
            if only is not None:
                size = min(pool.piece, pool.size - only * pool.piece)
                assert pinner._register(only * pool.piece, size) == 0
                pinner._pinned[only] = True
            pending = load_exact(only)
            assert only is not None or not pending.learn  # it pinned its pieces first
        assert load_exact("pinned").learn  # its pieces are pinned now
        pinner.release()
        pinner.failed = True  # as after a failed registration: the pageable way
        assert load_exact("pageable").learn
        assert not pinner._pinned.any()


def test_gpu_the_pool_is_pinned_beside_a_cuda_graph_capture() -> None:
    """vLLM captures its CUDA graphs (global capture mode) right after the connector
    starts pinning the node's pool: registrations on the pinning thread, in CUDA's
    relaxed capture mode, neither fail nor invalidate the capture, and the graph
    replays right."""
    size, piece = 256 << 20, 16 << 20
    buf = mmap.mmap(-1, size)
    ptr = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
    errors: list[int] = []
    capturing, pinned = threading.Event(), threading.Event()

    def pin() -> None:
        assert relax_capture_mode()
        capturing.wait(30)
        for off in range(0, size, piece):
            err = torch.cuda.cudart().cudaHostRegister(ptr + off, piece, 0x03)
            errors.append(int(getattr(err, "value", err)))
        pinned.set()

    x = torch.ones(1 << 16, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    thread = threading.Thread(target=pin)
    thread.start()
    with torch.cuda.graph(graph):
        capturing.set()
        y = x
        for _ in range(8):
            y = y * 2.0 - 1.0
        assert pinned.wait(60)  # every registration ran while this capture was open
        y = y + 1.0
    thread.join()
    assert errors == [0] * (size // piece)
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 2.0 * 2**8 + 2.0))  # (3 - 1) * 2^8 + 1, + 1
    for off in range(0, size, piece):
        torch.cuda.cudart().cudaHostUnregister(ptr + off)
