"""Test data for a cluster's blocks, and a raw connection to a node."""

from __future__ import annotations

import os

import numpy as np

from pegaflow.protocol.codec import unpack
from pegaflow.transport.ucx import UcxWorker, close_endpoint

BLOCK = 256 << 10
NS = "test-model"


def blocks(n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    return [os.urandom(32) for _ in range(n)], rng.integers(0, 255, size=(n, BLOCK), dtype=np.uint8)


class RawConn:
    """A bare UCX endpoint to a node, for sending hand-made (bad) messages."""

    def __init__(self, worker: UcxWorker, ep: object) -> None:
        self.w = worker
        self.ep = ep

    @classmethod
    async def open(cls, addr: str) -> RawConn:
        w = UcxWorker()
        host, port = addr.rsplit(":", 1)
        return cls(w, await w.connect(host, int(port), 2))

    async def ask(self, payload: bytes) -> dict:
        r = self.w.am_recv(self.ep)
        await self.w.wait(self.w.am_send(self.ep, payload), 5)
        await self.w.wait(r, 5)
        return unpack(bytes(r.recv_buffer), 1 << 20)

    def close(self) -> None:
        close_endpoint(self.ep)
        self.w.close()
