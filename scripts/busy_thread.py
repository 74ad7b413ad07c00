"""A thread that keeps the GIL busy the way vLLM's engine core input thread does: it
hashes each new request's blocks (sha256 of each pickled 16-token block, chained), one
request after another.  The benches of GIL-sensitive paths run beside it
(``--busy-thread``)."""

from __future__ import annotations

import hashlib
import pickle
import threading

BLOCK_TOKENS = 16


class BusyThread:
    """Hashes requests of ``blocks`` blocks from construction until :meth:`stop` (or
    the end of a ``with`` block); :attr:`requests` counts those hashed."""

    def __init__(self, blocks: int = 625) -> None:
        self.blocks = blocks
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            parent = bytes(32)
            for i in range(self.blocks):
                block = tuple(range(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS))
                parent = hashlib.sha256(pickle.dumps((parent, block, None))).digest()
            self.requests += 1

    def stop(self) -> None:
        """Stop hashing (after the request in progress)."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> BusyThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
