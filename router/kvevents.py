"""What each replica's GPU prefix cache holds, kept from the KV events vLLM publishes.

A replica started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``
publishes every change of its prefix cache as a ``KVEventBatch`` (msgpack, three frames
``topic, seq, payload``; ``seq`` counts batches from 0 per engine process) and keeps its
last batches for replay on a ROUTER socket (``vllm/distributed/kv_events.py``).  The
router subscribes to each replica named with ``;events=`` (and ``;replay=``) and keeps a
:class:`GpuView` per replica: the block hashes its engine's own cache holds (``medium``
``GPU`` or unset: the vLLM CPU build labels its cache ``GPU`` too), bounded to
``events_max_blocks`` (least recently stored forgotten first).

A view built from any unbroken run of batches is a subset of what the engine holds
(blocks stored before it are missing, never wrong); only a lost ``BlockRemoved`` makes it
claim a block the engine evicted.  So:

* a gap in ``seq`` is filled from the replay endpoint within ``events_timeout_s``; what
  cannot be filled (no replay endpoint, the batches rolled out of its buffer, no answer)
  clears the view, which rebuilds from the next batch;
* a ``seq`` lower than expected (not a replayed batch) or ``AllBlocksCleared`` is an
  engine restart or a cache reset: the view is cleared; so is a failed ``/health``;
* the last batches lost leave no gap to see until the next batch: with a replay endpoint
  the router asks it for anything after the last batch seen every ``events_stale_s / 2``
  while it has sent the replica requests since; a view whose replica was sent a request
  more than ``events_stale_s`` ago with no batch or replay answer since is *stale* and not
  used (also without a replay endpoint, where only the next batch confirms it).  So for
  requests this router sends, a lost event misleads its routing for at most
  ``events_stale_s``.

Payloads are decoded with msgpack into this module's frozen types; nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from pegaflow.errors import BadRequest

log = logging.getLogger("pegaflow.router")

END_SEQ = -1
"""the replay endpoint's last frame carries this sequence number"""
GPU_MEDIA = (None, "GPU")
"""``medium`` values of the engine's own KV cache"""
MAX_PAYLOAD = 64 << 20
"""larger event payloads are refused undecoded"""

BlockKey = bytes
"""the last 8 bytes of a vLLM block hash: the whole of it when the engines publish
64-bit integer hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), else unique enough"""


def block_key(h: bytes | int) -> BlockKey:
    """The :data:`BlockKey` of a router hash (bytes) or a published one (bytes or int)."""
    if isinstance(h, int):
        return (h & ((1 << 64) - 1)).to_bytes(8, "big")
    return bytes(h[-8:])


class BadEvent(BadRequest):
    """An event batch that is not vLLM's ``KVEventBatch``."""


@dataclass(frozen=True)
class Stored:
    """``BlockStored``: blocks entered the cache of ``medium``."""

    hashes: tuple[bytes | int, ...]
    parent: bytes | int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None
    group: int | None
    plain: bool
    """no LoRA and no extra keys: the router can compute these hashes"""


@dataclass(frozen=True)
class Removed:
    """``BlockRemoved``: blocks left the cache of ``medium``."""

    hashes: tuple[bytes | int, ...]
    medium: str | None
    group: int | None


@dataclass(frozen=True)
class Cleared:
    """``AllBlocksCleared``: the whole cache was reset."""


Event = Stored | Removed | Cleared


def _hash(v: Any) -> bytes | int:
    if isinstance(v, bytes | int) and not isinstance(v, bool):
        return v
    raise BadEvent(f"a block hash is {type(v).__name__}, not bytes or int")


def _event(d: Any) -> Event | None:
    """One decoded event; ``None`` for a type this router does not know."""
    if not isinstance(d, dict):
        raise BadEvent("an event is not a map")
    kind = d.get("type")
    try:
        if kind == "BlockStored":
            parent = d.get("parent_block_hash")
            tokens = d.get("token_ids") or []
            if not all(isinstance(t, int) for t in tokens):
                raise BadEvent("BlockStored.token_ids are not integers")
            plain = not d.get("lora_name") and d.get("lora_id") is None
            plain = plain and not any(d.get("extra_keys") or ())
            return Stored(
                hashes=tuple(_hash(h) for h in d["block_hashes"]),
                parent=None if parent is None else _hash(parent),
                token_ids=tuple(tokens),
                block_size=int(d["block_size"]),
                medium=d.get("medium"),
                group=d.get("group_idx"),
                plain=plain,
            )
        if kind == "BlockRemoved":
            return Removed(
                tuple(_hash(h) for h in d["block_hashes"]), d.get("medium"), d.get("group_idx")
            )
    except (KeyError, TypeError, ValueError) as e:
        raise BadEvent(f"{kind}: {type(e).__name__}: {e}") from None
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one ``KVEventBatch`` payload (``[ts, events, dp_rank]``); events
    of unknown types are left out; ``BadEvent`` for anything else."""
    if len(payload) > MAX_PAYLOAD:
        raise BadEvent(f"an event batch of {len(payload)} bytes (at most {MAX_PAYLOAD})")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise BadEvent(f"not msgpack: {e}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise BadEvent("not a KVEventBatch ([ts, events, ...])")
    return [ev for ev in map(_event, batch[1]) if ev is not None]


class GpuView:
    """The block keys one replica's engine holds in its own cache (see the module
    docstring for when it is used), bounded to ``capacity`` keys."""

    def __init__(self, capacity: int, stale_s: float) -> None:
        self.capacity = capacity
        self.stale_s = stale_s
        self._keys: OrderedDict[BlockKey, None] = OrderedDict()
        self.next_seq: int | None = None
        """the batch expected next; ``None``: none seen since the view was cleared"""
        self.replayed_from: int | None = None
        """lower sequence numbers than :attr:`next_seq` from here are replayed copies"""
        self.confirmed_at = 0.0
        """monotonic time before which every published batch is applied"""
        self.touched = 0.0
        """monotonic time a request of this router to the replica last began or ended"""
        self.pending_since = 0.0
        """monotonic time of the first such touch after the last confirmation"""
        self.hash_check = "pending"
        """``ok``, ``mismatch`` (never used) or ``pending``: the router's hashes of the
        first plain stored blocks against the engine's"""
        self.batches = 0
        self.resyncs = 0
        self.restarts = 0

    def __len__(self) -> int:
        return len(self._keys)

    def pending(self) -> bool:
        """Whether the replica may have published batches not seen yet (a request of
        this router began or ended since the last confirmation)."""
        return self.touched > self.confirmed_at

    def usable(self, now: float) -> bool:
        """Whether routing may rely on this view now (the module docstring's bound)."""
        if self.hash_check == "mismatch" or self.next_seq is None:
            return False
        return not self.pending() or now - self.pending_since < self.stale_s

    def touch(self, now: float) -> None:
        """A request of this router to the replica began or ended."""
        if not self.pending():  # what it publishes from now on is unseen until confirmed
            self.pending_since = now
        self.touched = now

    def clear(self) -> None:
        """Forget everything: the engine restarted, its cache was reset, or batches were
        lost; the view rebuilds from the next batch."""
        self._keys.clear()
        self.next_seq = None
        self.replayed_from = None

    def apply(self, events: Sequence[Event]) -> None:
        """Apply one batch's events."""
        keys = self._keys
        for ev in events:
            if isinstance(ev, Cleared):
                keys.clear()
            elif ev.medium not in GPU_MEDIA or ev.group not in (None, 0):
                continue
            elif isinstance(ev, Stored):
                for h in ev.hashes:
                    k = block_key(h)
                    keys[k] = None
                    keys.move_to_end(k)
                while len(keys) > self.capacity:
                    keys.popitem(last=False)
            else:
                for h in ev.hashes:
                    keys.pop(block_key(h), None)

    def prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of ``keys`` the engine holds."""
        held = self._keys
        for i, k in enumerate(keys):
            if k not in held:
                return i
        return len(keys)

    def status(self) -> dict[str, Any]:
        """The view as ``/v1/status`` shows it."""
        return {
            "usable": self.usable(time.monotonic()),
            "blocks": len(self),
            "next_seq": self.next_seq,
            "hash_check": self.hash_check,
            "batches": self.batches,
            "resyncs": self.resyncs,
            "restarts": self.restarts,
        }


Checker = Callable[[Stored], bool | None]
"""whether the router's hashes of a stored event's tokens equal the engine's (None:
cannot tell)"""


def _ignore(_outcome: str) -> None:
    pass


@dataclass
class Subscription:
    """One replica's KV events: a SUB socket on ``endpoint``, gaps filled from
    ``replay`` (may be empty), applied to :attr:`view`.  :meth:`run` until cancelled."""

    name: str
    endpoint: str
    replay: str
    view: GpuView
    check: Checker
    """the hash check of :attr:`GpuView.hash_check`"""
    timeout_s: float
    """deadline of one replay request"""
    topic: str = ""
    on_batch: Callable[[str], None] = _ignore
    """told each message's outcome (``applied``, ``lost``, ``restart``, ``bad``)"""
    bad: int = field(default=0, init=False)

    async def run(self) -> None:
        """Subscribe and apply batches until cancelled; with a replay endpoint, confirm
        a pending view every ``stale_s / 2``.  An unexpected failure is logged, the view
        cleared, and the subscription begun again a second later."""
        while True:
            try:
                await self._follow()
            except Exception:
                log.exception("replica %s: KV events subscription failed; again in 1 s", self.name)
                self.view.clear()
                await asyncio.sleep(1.0)

    async def _follow(self) -> None:
        import zmq
        import zmq.asyncio

        sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        view, half = self.view, self.view.stale_s / 2
        try:
            while True:
                if await sub.poll(max(20, int(half * 1000)), zmq.POLLIN):
                    await self.receive(await sub.recv_multipart())
                now = time.monotonic()
                if self.replay and view.pending() and now - view.confirmed_at >= half:
                    await self._fill(view.next_seq or 0, check=True)
        finally:
            sub.close(linger=0)

    async def receive(self, frames: Sequence[bytes]) -> None:
        """One published message ``topic, seq, payload``."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._bad(f"a message of {len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        view = self.view
        if view.next_seq is None:
            if not (seq > 0 and await self._fill(0)):  # the history its replay buffer keeps
                view.next_seq = seq
        elif seq < view.next_seq:
            if view.replayed_from is not None and seq >= view.replayed_from:
                return  # a copy of a batch replayed already
            log.info("replica %s restarted its KV events (seq %d after %d): view cleared",
                     self.name, seq, view.next_seq - 1)  # fmt: skip
            view.restarts += 1
            view.clear()
            view.next_seq = seq
            self.on_batch("restart")
        elif seq > view.next_seq and not await self._fill(view.next_seq):
            log.info("replica %s: KV event batches %d-%d lost and not replayed: view cleared",
                     self.name, view.next_seq, seq - 1)  # fmt: skip
            view.clear()
            view.resyncs += 1
            view.next_seq = seq
            self.on_batch("lost")
        if view.next_seq is not None and seq < view.next_seq:
            return  # replayed just now
        view.replayed_from = None
        self._apply(seq, frames[2], time.monotonic())

    def _apply(self, seq: int, payload: bytes, confirm_at: float | None) -> None:
        """Apply batch ``seq``; ``confirm_at``: every batch published before it is in."""
        view = self.view
        try:
            events = decode_batch(payload)
        except BadEvent as e:
            self._bad(str(e))
            view.clear()  # the batch's changes are unknown
            view.next_seq = seq + 1
            return
        if view.hash_check == "pending":
            self._check_hashes(events)
        view.apply(events)
        view.next_seq = seq + 1
        view.batches += 1
        if confirm_at is not None:
            view.confirmed_at = confirm_at
        self.on_batch("applied")

    def _check_hashes(self, events: Sequence[Event]) -> None:
        for ev in events:
            if not isinstance(ev, Stored) or not ev.plain or ev.medium not in GPU_MEDIA:
                continue
            same = self.check(ev)
            if same is None:
                continue
            self.view.hash_check = "ok" if same else "mismatch"
            if not same:
                log.error(
                    "replica %s: the router's block hashes differ from the engine's (check "
                    "--router-block-size, --router-hash-algo, --router-hash-seed against the "
                    "engine's --block-size, --prefix-caching-hash-algo, PYTHONHASHSEED): its "
                    "KV events are not used, it is routed on the pool and recent routes",
                    self.name,
                )
            return

    def _bad(self, why: str) -> None:
        self.bad += 1
        self.on_batch("bad")
        if self.bad == 1 or self.bad % 1000 == 0:
            log.warning(
                "replica %s: bad KV event message (%s); %d so far", self.name, why, self.bad
            )

    async def _fill(self, start: int, check: bool = False) -> bool:
        """Ask the replay endpoint for the batches from ``start`` and apply them, within
        ``timeout_s``; whether the view now holds every batch up to the replay's answer.
        ``start`` 0: the history the buffer keeps (from its oldest batch: a subset of
        what the engine holds).  Batches from ``start`` on rolled out of the buffer: the
        view is cleared (``check``: counted as a resync)."""
        if not self.replay:
            return False
        import zmq
        import zmq.asyncio

        view = self.view
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay)
        asked = time.monotonic()
        expect = start
        try:
            async with asyncio.timeout(self.timeout_s):
                await sock.send_multipart([b"", start.to_bytes(8, "big")])
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 4 or len(frames[2]) != 8:
                        self._bad(f"a replay answer of {len(frames)} frames")
                        return False
                    seq = int.from_bytes(frames[2], "big", signed=True)
                    if seq == END_SEQ:
                        break
                    if seq < expect:
                        continue
                    if seq > expect:
                        if start > 0:  # rolled out of the buffer: lost for good
                            view.clear()
                            if check:
                                view.resyncs += 1
                                self.on_batch("lost")
                            return False
                        view.clear()
                    self._apply(seq, frames[3], None)
                    expect = seq + 1
        except TimeoutError:
            log.debug("replica %s: replay from %d timed out", self.name, start)
            return False
        finally:
            sock.close(linger=0)
        if view.next_seq is None:
            return False  # an empty buffer: nothing to start from
        view.replayed_from = start
        view.confirmed_at = asked
        return True
