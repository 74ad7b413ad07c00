#!/usr/bin/env python3
"""A client worker of the chaos suite (``scripts/chaos.py``), in a process of its own.

Its own event loop and UCX worker: ``--tasks`` op loops (puts, lookups with
generations, gets) and a 20 ms ticker on one loop, sharing one
:class:`pegaflow.client.PegaClient`.  Every block's bytes are derived from its hash
(:func:`block_bytes`), so every block a get reports fetched is checked when the get
returns, and each staging buffer again before it is reused (late writes).  Events go
to a JSON-lines file the orchestrator folds; the ticker's heartbeat and each task's
in-flight deadline go to a shared array it watches.  The constants here are the
protocol between the two.

    python scripts/chaos_worker.py CONFIG.json   # started by scripts/chaos.py
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NS = "chaos"
HASH_LEN = 32
LOOKUP_DEADLINE_S = 1.0
TRANSFER_DEADLINE_S = 2.0
TICK_S = 0.02
FREEZE_LOG_S = 0.2
RING = 4
"""staging buffers per client task, reused in turn"""
KIND_CODES = {"put": 1.0, "lookup": 2.0, "get": 3.0}
"""the kind of each task's call in flight, as the heartbeat array holds it"""
DEADLINES_S = {"put": TRANSFER_DEADLINE_S, "lookup": LOOKUP_DEADLINE_S, "get": TRANSFER_DEADLINE_S}


def block_bytes(h: bytes, size: int) -> np.ndarray:
    """The content every block with hash ``h`` (and ``size`` bytes) must have."""
    return np.frombuffer(h * (size // len(h)), dtype=np.uint8)


@dataclass
class _Staging:
    """A staging buffer and what each row must hold now (a hash's bytes, or zeros)."""

    buf: np.ndarray
    rows: list[bytes | None]


class Worker:
    """One client process: ``tasks`` op loops and a ticker on one event loop, sharing one
    :class:`PegaClient`.  Events go to a JSON-lines file; the ticker's heartbeat and
    each task's in-flight deadline go to a shared array the orchestrator watches."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.index = int(cfg["index"])
        self.tasks = int(cfg["tasks"])
        self.nodes: list[str] = list(cfg["nodes"])
        self.think_s = float(cfg["think_s"])
        self.block = int(cfg["block_kib"]) << 10
        self.batch = int(cfg["batch"])
        self.out: IO[str] = open(cfg["events"], "a", buffering=1)
        beats = np.memmap(cfg["beats"], dtype=np.float64, mode="r+")
        self.beats = beats.reshape(int(cfg["workers"]), -1)[self.index]
        self.stop = asyncio.Event()
        self.known: list[tuple[list[bytes], float]] = []
        """(hashes, when their put returned), latest last"""
        self.max_freeze_s = 0.0

    def emit(self, **event: Any) -> None:
        """One event line."""
        self.out.write(json.dumps(event, separators=(",", ":")) + "\n")

    def emit_op(
        self, kind: str, target: str, t0: float, t1: float, err: str | None, **more: Any
    ) -> None:
        """The event of one client call of ``kind`` against ``target``."""
        self.emit(e="op", k=kind, tg=target, t0=t0, t1=t1, dl=DEADLINES_S[kind], err=err, **more)

    async def run(self) -> None:
        from pegaflow.client import PegaClient  # UCX starts here, after UCX_TLS was set

        from pegaflow.config import ClientConfig

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        loop.add_signal_handler(signal.SIGINT, self.stop.set)
        self.client = PegaClient(
            ClientConfig(
                coordinators=list(self.cfg["coordinators"]),
                lookup_timeout_s=LOOKUP_DEADLINE_S,
                rpc_timeout_s=TRANSFER_DEADLINE_S,
                transfer_timeout_s=TRANSFER_DEADLINE_S,
            )
        )
        rings = [
            [
                _Staging(np.zeros((self.batch, self.block), np.uint8), [None] * self.batch)
                for _ in range(RING)
            ]
            for _ in range(self.tasks)
        ]
        ticker = asyncio.create_task(self._ticker())
        self.emit(e="ready", t=time.monotonic())
        try:
            await asyncio.gather(*(self._ops(k, rings[k]) for k in range(self.tasks)))
            # late writes may still land: wait, then check every buffer one last time
            await asyncio.sleep(1.0)
            for ring in rings:
                for st in ring:
                    self._check_staging(st)
        finally:
            ticker.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.client.close(), 5.0)
            self.emit(e="end", t=time.monotonic(), max_freeze_ms=round(self.max_freeze_s * 1e3))
            self.out.close()

    async def _ticker(self) -> None:
        parent = os.getppid()
        prev = time.monotonic()
        while True:
            self.beats[0] = prev
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            late = now - prev - TICK_S
            prev = now
            if late > self.max_freeze_s:
                self.max_freeze_s = late
            if late >= FREEZE_LOG_S:
                self.emit(e="freeze", t=now, ms=round(late * 1e3, 1))
            if os.getppid() != parent:  # the orchestrator is gone
                self.stop.set()

    async def _timed(
        self, task: int, kind: str, coro: Coroutine[Any, Any, Any]
    ) -> tuple[Any, str | None, float, float]:
        """Run one client call of ``kind`` (its deadline: :data:`DEADLINES_S`); returns
        (result, error code or None, start, end)."""
        from pegaflow.errors import PegaError

        slot = 1 + 2 * task
        t0 = time.monotonic()
        self.beats[slot + 1] = KIND_CODES[kind]
        self.beats[slot] = t0 + DEADLINES_S[kind]
        res: Any = None
        err: str | None = None
        try:
            res = await coro
        except PegaError as e:
            err = e.code
        except Exception as e:  # an untyped error escaping the client is a defect
            err = f"untyped:{type(e).__name__}:{str(e)[:120]}"
        finally:
            self.beats[slot] = 0.0
        return res, err, t0, time.monotonic()

    async def _ops(self, task: int, ring: list[_Staging]) -> None:
        rng = random.Random(f"{self.cfg['seed']}/{self.index}/{task}")
        turn = 0
        while not self.stop.is_set():
            r = rng.random()
            if r < 0.35 or not self.known:
                await self._put(task, rng)
            else:
                st = ring[turn % RING]
                turn += 1
                await self._lookup_get(task, rng, st, fetch=r >= 0.5)
            await asyncio.sleep(rng.uniform(0.5, 1.5) * self.think_s)

    async def _put(self, task: int, rng: random.Random) -> None:
        node = rng.choice(self.nodes)
        hashes = [rng.randbytes(HASH_LEN) for _ in range(self.batch)]
        items = [(h, 0, block_bytes(h, self.block)) for h in hashes]
        res, err, t0, t1 = await self._timed(
            task,
            "put",
            self.client.put_blocks(NS, items, node_id=node, timeout=TRANSFER_DEADLINE_S),
        )
        stored = 0 if res is None else res.stored + res.skipped
        self.emit_op("put", node, t0, t1, err, n=stored, h=hashes[0].hex())
        if err is None and stored:
            self.known.append((hashes, t1))
            del self.known[: max(0, len(self.known) - 2000)]

    async def _lookup_get(self, task: int, rng: random.Random, st: _Staging, fetch: bool) -> None:
        if rng.random() < 0.5:
            hashes, put_t = self.known[-1]
        else:
            hashes, put_t = self.known[
                rng.randrange(max(0, len(self.known) - 500), len(self.known))
            ]
        found, err, t0, t1 = await self._timed(
            task,
            "lookup",
            self.client.lookup(NS, hashes, timeout=LOOKUP_DEADLINE_S, generations=True),
        )
        hits = 0 if found is None else found.hits
        # the target: the coordinator that answered (or failed)
        self.emit_op("lookup", self.client._rpc.current_address, t0, t1, err, hits=hits, pt=put_t)
        if not fetch or not hits:
            return
        self._check_staging(st)
        st.buf[:] = 0
        st.rows = [None] * self.batch
        items = [(found.blocks[j][0], hashes[j], 0, st.buf[j]) for j in range(hits)]
        gens = [g[0] for g in found.generations]
        ok, err, t0, t1 = await self._timed(
            task,
            "get",
            self.client.get_blocks(NS, items, timeout=TRANSFER_DEADLINE_S, generations=gens),
        )
        per_node: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        wrong: dict[str, int] = Counter()
        for j in range(hits):
            node = items[j][0]
            per_node[node][0] += 1
            if ok is not None and ok[j]:
                per_node[node][1] += 1
                if not np.array_equal(st.buf[j], block_bytes(hashes[j], self.block)):
                    wrong[node] += 1
                st.rows[j] = hashes[j]
            else:
                st.buf[j] = 0  # what the caller does with a miss's buffer; must stay zero
        self.emit_op("get", "", t0, t1, err, nodes=per_node, pt=put_t)
        for node, n in wrong.items():
            self.emit(e="bad", where="return", t=t1, node=node, n=n)

    def _check_staging(self, st: _Staging) -> None:
        """Before reuse: every row still holds what the caller was given back."""
        late = verified = 0
        for j, h in enumerate(st.rows):
            if h is None:
                if st.buf[j].any():
                    late += 1
            elif not np.array_equal(st.buf[j], block_bytes(h, self.block)):
                late += 1
                verified += 1
        if late:
            self.emit(e="bad", where="late", t=time.monotonic(), n=late, verified=verified)


def main() -> None:
    """Entry point of a client worker process: ``chaos_worker.py CONFIG``."""
    cfg = json.loads(Path(sys.argv[1]).read_text())
    import uvloop

    uvloop.run(Worker(cfg).run())


if __name__ == "__main__":
    main()
