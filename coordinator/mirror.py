"""Keeps a :class:`~pegaflow.coordinator.index.BlockIndex` equal to the index in etcd.

Start: the cluster epoch (``epoch`` key, created if absent, see :mod:`pegaflow.keys`),
then a paged range read of ``nodes/`` then ``blocks/``, both at one revision.  The first
load goes straight into the served index, page by page, so that lookups are answered
from what has been read while it runs (``state`` is ``loading``, with the keys read of
the total); :meth:`EtcdMirror.start` waits for it to finish only when it has at most
``wait_load_keys`` block keys.  A later full read (a reload) builds a fresh index that
replaces the served one in one step.  Then a watch of the whole
cluster prefix from the next revision.  When the watch breaks it is resumed from the
last applied revision, and the mirror checks that it still speaks to the etcd it loaded
from: it reads everything again when the epoch changed or vanished, the revision went
back, or the cluster id changed (etcd rebuilt from empty, restored from a backup, the
prefix wiped), and when the revision to resume from was compacted.  An epoch change
seen on the watch does the same.  Nodes republish their inventories into a rebuilt etcd
by themselves (their leases are gone); the reload and then the watch pick that up.

Meanwhile lookups keep being served from the last state (mostly still right: nodes keep
their blocks through an etcd rebuild, and readers fence their gets by generation), and
``connected``/``lag_revisions`` say how current it is.

A block key's node is taken from its lease (the node record carries the same lease), or
from its value when the lease is unknown; the value's generation goes into the index
(lookups can return it, readers fence their gets with it), and so does whether its slot
is :data:`~pegaflow.keys.DISK_SLOT` (the block is only on its node's disk tier).
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import KW_ONLY, InitVar, dataclass
from typing import Any

import msgpack
from aetcd import rpc

from pegaflow.errors import PegaError, Unavailable
from pegaflow.etcd import PUT, EtcdClient, RevisionCompacted, Watch, prefix_range_end
from pegaflow.keys import DISK_SLOT, Keyspace, NodeRecord, new_cluster_epoch
from pegaflow.lifecycle import Backoff, Supervised
from pegaflow.protocol.codec import GEN_MAX

from .index import BlockIndex

log = logging.getLogger(__name__)

_HEX = [bytes((c,)) for c in b"0123456789abcdef"]
_LOAD_STREAMS = 3  # slices of the index read at once by a full load
_unpackb = msgpack.unpackb


class _OtherEtcd(Exception):
    """The etcd answering is not the one the index was loaded from."""


@dataclass(eq=False, repr=False)
class EtcdMirror:
    """Feeds ``index`` from etcd until closed; never raises for an etcd outage."""

    client: EtcdClient
    keys: Keyspace
    index: BlockIndex
    _: KW_ONLY
    progress_interval_s: InitVar[float] = 2.0
    page_size: InitVar[int] = 10000
    wait_load_keys: InitVar[int] = 100_000

    def __post_init__(
        self, progress_interval_s: float, page_size: int, wait_load_keys: int
    ) -> None:
        self._progress_interval = progress_interval_s
        self._wait_load_keys = wait_load_keys
        self._page_size = page_size
        self._split_over = 8 * page_size  # keys above which a range is read in slices
        self._root = (self.keys.prefix + "/").encode()
        self._bprefix = self.keys.blocks.encode()
        self._blen = len(self._bprefix)
        self._nprefix = self.keys.nodes.encode()
        self._nlen = len(self._nprefix)
        self._epoch_key = self.keys.epoch_key
        self._leases: dict[int, str] = {}
        self._ns_names: dict[bytes, str] = {}
        self._backoff = Backoff(0.1)
        self._loop = Supervised(
            "etcd-mirror", self._round, on_error=self._round_failed, backoff=self._backoff
        )
        self._full = True  # the next round reads everything first
        self._streak = 0  # reloads in a row without a watch that followed
        self._synced = asyncio.Event()
        self._serving = asyncio.Event()  # synced, or a big first load under way
        self._partial = False  # the index holds part of a first load that failed
        self._last_rx = 0.0
        self._cluster_id = 0

        #: Whether a watch is open and answering.
        self.connected = False
        #: Last revision whose events are all applied.
        self.revision = 0
        #: Latest etcd revision seen in any response.
        self.etcd_revision = 0
        self.events = 0
        self.full_syncs = 0
        #: Cluster epoch of the etcd the index was loaded from ("" before the first load).
        self.epoch = ""
        #: Full reloads forced by another etcd or by compaction (not the first load).
        self.reloads = 0
        #: Why the last of those happened.
        self.last_reload = ""
        self.watch_errors = 0
        self.bad_keys = 0
        self.last_sync_s = 0.0
        #: Whether a full read runs now.
        self.loading = False
        #: Block keys read by the running (or last) full read, and how many it has.
        self.load_keys_read = 0
        self.load_keys_total = 0
        self.disconnected_since: float | None = time.monotonic()

    # -- lifecycle --------------------------------------------------------------------

    async def start(self, wait_s: float | None = None) -> bool:
        """Start mirroring; wait up to ``wait_s`` for the first full read, or only until
        it is under way when it has more than ``wait_load_keys`` block keys (lookups are
        then served from what it has read).  Returns whether the index is served from
        etcd (if not, the mirror keeps trying in the background)."""
        if not self._loop.running:
            self._full, self._streak = True, 0  # every start reads everything first
        self._loop.start()
        if wait_s is None:
            return self.synced
        try:
            await asyncio.wait_for(self._serving.wait(), wait_s)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stop mirroring (the index keeps its last state)."""
        await self._loop.close()
        self.connected = False

    @property
    def synced(self) -> bool:
        """Whether a full read has completed at least once."""
        return self._synced.is_set()

    @property
    def lag_revisions(self) -> int:
        """How many etcd revisions the index is behind the latest one seen."""
        return max(0, self.etcd_revision - self.revision)

    @property
    def state(self) -> str:
        """``loading`` (a full read runs), ``watching`` or ``disconnected``."""
        if self.loading:
            return "loading"
        return "watching" if self.connected else "disconnected"

    def status(self) -> dict[str, Any]:
        """The mirror's state for status pages."""
        return {
            "state": self.state,
            "load_keys_read": self.load_keys_read,
            "load_keys_total": self.load_keys_total,
            "etcd_connected": self.connected,
            "synced": self.synced,
            "revision": self.revision,
            "etcd_revision": self.etcd_revision,
            "lag_revisions": self.lag_revisions,
            "events": self.events,
            "full_syncs": self.full_syncs,
            "epoch": self.epoch,
            "reloads": self.reloads,
            "last_reload": self.last_reload,
            "watch_errors": self.watch_errors,
            "disconnected_s": (
                round(time.monotonic() - self.disconnected_since, 3)
                if self.disconnected_since is not None
                else 0.0
            ),
        }

    # -- loop -------------------------------------------------------------------------

    async def _round(self) -> bool:
        """Load (when due), open a watch where the index stands and follow it until it
        breaks; the loop then pauses by the backoff (reset by every watch that opened)."""
        try:
            if self._full:
                await self._full_sync()
                self._full = False
            watch = await self.client.watch(self._root, self.revision + 1)
            try:
                # After the watch is open: a later epoch change arrives on it.
                await self._check_same_etcd(watch)
            except BaseException:
                watch.cancel()
                raise
            self._cluster_id = watch.cluster_id
            self._set_connected(True)
            self._backoff.reset()
            self._streak = 0
            await self._follow(watch)
        finally:
            self._set_connected(False)
        return False

    def _round_failed(self, e: Exception) -> None:
        if isinstance(e, _OtherEtcd):
            self._note_reload(
                f"etcd at {self.client.endpoint} is not the one the index was loaded from: {e}",
                "etcd rebuilt, restored or wiped? Nodes republish their blocks by themselves",
            )
        elif isinstance(e, RevisionCompacted):
            self._note_reload(
                f"etcd history compacted past revision {self.revision} ({e})",
                "the watch fell behind",
            )
        elif isinstance(e, PegaError):
            self.watch_errors += 1
            if self._backoff.failures == 0:
                if self.synced:
                    state = f"serving the last state (revision {self.revision})"
                else:
                    state = "no index loaded yet (check that etcd runs at those endpoints)"
                log.warning(
                    "etcd unreachable for the index mirror (%s); %s; retrying with backoff",
                    e,
                    state,
                )
        else:
            self.watch_errors += 1
            log.exception("index mirror failed; retrying")

    def _note_reload(self, what: str, hint: str) -> None:
        self._full = True
        self._backoff.failures = self._streak  # soon, not after an outage's backoff
        self._streak += 1
        self.reloads += 1
        self.last_reload = what
        log.warning(
            "%s; reading the whole index again (%s); lookups are served from the last "
            "state until it is loaded",
            what,
            hint,
        )

    async def _check_same_etcd(self, watch: Watch) -> None:
        """Raise :class:`_OtherEtcd` unless ``watch`` is on the etcd the index came from."""
        if watch.created_revision < self.revision:
            raise _OtherEtcd(
                f"its revision went back from {self.revision} to {watch.created_revision}"
            )
        if self._cluster_id and watch.cluster_id != self._cluster_id:
            raise _OtherEtcd(
                f"its cluster id changed from {self._cluster_id:x} to {watch.cluster_id:x}"
            )
        kv = await self.client.get(self._epoch_key)
        if kv is None:
            raise _OtherEtcd(f"its cluster epoch is missing (was {self.epoch})")
        if kv.value.decode(errors="replace") != self.epoch:
            raise _OtherEtcd(
                f"its cluster epoch is {kv.value.decode(errors='replace')!r}, not {self.epoch!r}"
            )

    async def _load_epoch(self) -> str:
        """The cluster epoch, created first if absent (every coordinator agrees)."""
        value, created = await self.client.put_if_absent(self._epoch_key, new_cluster_epoch())
        epoch = value.decode(errors="replace")
        if created:
            log.info("created the cluster epoch %s at %s", epoch, self.keys.prefix)
        return epoch

    def _set_connected(self, up: bool) -> None:
        if up and not self.connected:
            if self.disconnected_since is not None and self.full_syncs and self.watch_errors:
                log.info(
                    "index mirror back on etcd at %s (revision %d, was away %.1f s)",
                    self.client.endpoint,
                    self.revision,
                    time.monotonic() - self.disconnected_since,
                )
            self.disconnected_since = None
        elif not up and self.connected:
            self.disconnected_since = time.monotonic()
        self.connected = up

    async def _full_sync(self) -> None:
        t0 = time.monotonic()
        # Read before the range: an etcd swapped in between shows as a changed epoch
        # when the watch opens.
        epoch = await self._load_epoch()
        first = not self.synced  # nothing to keep serving: load in place
        if first and self._partial:  # an earlier attempt stopped halfway
            self.index.replace_with(BlockIndex())
        self._partial = first
        fresh = self.index if first else BlockIndex()
        leases: dict[int, str] = {}
        rev = 0
        self.loading, self.load_keys_read, self.load_keys_total = True, 0, 0
        try:
            async for page_rev, kvs in self.client.range_pages(self.keys.nodes.encode()):
                rev = page_rev
                for kv in kvs:
                    self._node_put(fresh, leases, kv)
            await self._scan_blocks(fresh, leases, rev, first)
        finally:
            self.loading = False
        if not first:
            self.index.replace_with(fresh)
        self._leases = leases
        self.revision = rev
        self.etcd_revision = rev  # the current revision: not max(), etcd may have gone back
        self.epoch = epoch
        self._cluster_id = 0  # taken from the next watch
        self.full_syncs += 1
        self.last_sync_s = time.monotonic() - t0
        self._partial = False
        self._synced.set()
        self._serving.set()
        log.info(
            "index loaded from etcd: %d blocks, %d nodes at revision %d (cluster epoch %s) "
            "in %.2f s",
            self.index.num_blocks,
            self.index.num_nodes,
            rev,
            epoch,
            self.last_sync_s,
        )

    async def _scan_blocks(
        self, index: BlockIndex, leases: dict[int, str], rev: int, first: bool
    ) -> None:
        """Read every block key at ``rev`` (``first``: the first load, served while it
        runs when it is big).

        etcd 3.4 walks the whole rest of a range for every page it returns (to count
        it), so paging a million keys costs O(n^2).  A big namespace is therefore read
        in slices by the leading hex digits of the hash (uniform for real hashes), each
        small enough to page cheaply, :data:`_LOAD_STREAMS` slices at a time: etcd reads
        the next pages while this process adds the last ones."""
        cursor, end = self._bprefix, prefix_range_end(self._bprefix)
        count, _, _ = await self.client.probe(cursor, end, revision=rev)
        self.load_keys_total = count
        if first and count > self._wait_load_keys:
            self._serving.set()
        slices: list[tuple[bytes, bytes]] = []
        while cursor < end:
            count, first_key, _ = await self.client.probe(cursor, end, revision=rev)
            if first_key is None:
                break
            slash = first_key.find(b"/", self._blen)
            if count <= self._split_over or slash < 0:
                slices.append((cursor, end))
                break
            ns_prefix = first_key[: slash + 1]  # no key in [cursor, first_key)
            await self._slice(rev, ns_prefix, 0, slices)
            cursor = prefix_range_end(ns_prefix)
        todo = iter(slices)

        async def reader() -> None:
            for lo, hi in todo:
                await self._scan_range(index, leases, rev, lo, hi)

        readers = [asyncio.create_task(reader()) for _ in range(_LOAD_STREAMS)]
        try:
            await asyncio.gather(*readers)  # the first error as it is (etcd down, ...)
        finally:
            for t in readers:
                t.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def _slice(
        self, rev: int, prefix: bytes, depth: int, out: list[tuple[bytes, bytes]]
    ) -> None:
        """Append to ``out`` slices covering ``[prefix, its range end)``, each small
        enough (or 4 hex digits deep)."""
        end = prefix_range_end(prefix)
        if depth < 4:
            count, _, _ = await self.client.probe(prefix, end, revision=rev)
            if count > self._split_over:
                # Below "0", each hex digit, above "f": together exactly [prefix, end).
                out.append((prefix, prefix + b"0"))
                for digit in _HEX:
                    await self._slice(rev, prefix + digit, depth + 1, out)
                out.append((prefix + b"g", end))
                return
        out.append((prefix, end))

    async def _scan_range(
        self, index: BlockIndex, leases: dict[int, str], rev: int, lo: bytes, hi: bytes
    ) -> None:
        async for _, kvs in self.client.range_pages(
            lo, end=hi, revision=rev, page_size=self._page_size
        ):
            self._block_puts(index, leases, kvs)

    async def _follow(self, watch: Watch) -> None:
        self._last_rx = time.monotonic()
        dog = asyncio.create_task(self._watchdog(watch), name="etcd-mirror-watchdog")
        try:
            async for r in watch.responses():
                self._last_rx = time.monotonic()
                self._apply(r)
        finally:
            dog.cancel()
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await dog

    async def _watchdog(self, watch: Watch) -> None:
        """Asks for progress when the stream is quiet; cancels it when etcd stays silent
        (the watch's deadline: a dead etcd behind a live TCP connection)."""
        while True:
            await asyncio.sleep(self._progress_interval)
            if time.monotonic() - self._last_rx < self._progress_interval:
                continue
            sent = time.monotonic()
            try:
                async with asyncio.timeout(self.client.timeout):
                    await watch.request_progress()
            except (TimeoutError, Unavailable):
                pass
            await asyncio.sleep(self.client.timeout)
            if self._last_rx < sent:
                log.warning(
                    "etcd watch silent for %.1f s; reconnecting", time.monotonic() - self._last_rx
                )
                watch.cancel()
                return

    # -- applying etcd data -----------------------------------------------------------

    def _apply(self, r: rpc.WatchResponse) -> None:
        rev = r.header.revision
        if rev > self.etcd_revision:
            self.etcd_revision = rev
        events = r.events
        if not events:  # progress notification: everything up to rev was delivered
            if rev > self.revision:
                self.revision = rev
            return
        index = self.index
        bprefix, blen, leases = self._bprefix, self._blen, self._leases
        evictions, now = index.evictions, time.monotonic()
        for ev in events:
            kv = ev.kv
            key = kv.key
            if key.startswith(bprefix):
                parsed = self._parse_block_key(key[blen:])
                if parsed is None:
                    continue
                ns, h, shard = parsed
                if ev.type == PUT:
                    loc = self._location(leases, kv)
                    if loc is not None:
                        index.add(ns, h, shard, loc[0], loc[1], loc[2])
                        if evictions is not None:
                            evictions.saved(h, now)
                else:
                    if evictions is not None:
                        evictions.removing(ns, h, shard, now)
                    index.remove(ns, h, shard)
            elif key.startswith(self._nprefix):
                if ev.type == PUT:
                    self._node_put(index, leases, kv)
                else:
                    node_id = key[self._nlen :].decode(errors="replace")
                    for lease in [k for k, v in leases.items() if v == node_id]:
                        del leases[lease]
                    index.remove_node(node_id)
            elif key == self._epoch_key:
                value = kv.value.decode(errors="replace")
                if ev.type != PUT or value != self.epoch:
                    what = f"rewritten to {value!r}" if ev.type == PUT else "deleted"
                    raise _OtherEtcd(f"its cluster epoch {self.epoch!r} was {what}")
        self.events += len(events)
        if not r.fragment:
            last = events[-1].kv.mod_revision
            if last > self.revision:
                self.revision = last

    def _block_puts(
        self, index: BlockIndex, leases: dict[int, str], kvs: Sequence[rpc.KeyValue]
    ) -> None:
        self.load_keys_read += len(kvs)
        blen = self._blen
        add = index.add
        parse = self._parse_block_key
        location = self._location
        for kv in kvs:
            parsed = parse(kv.key[blen:])
            if parsed is None:
                continue
            loc = location(leases, kv)
            if loc is not None:
                add(parsed[0], parsed[1], parsed[2], loc[0], loc[1], loc[2])

    def _node_put(self, index: BlockIndex, leases: dict[int, str], kv: rpc.KeyValue) -> None:
        try:
            rec = NodeRecord.decode(kv.value)
        except (PegaError, TypeError, ValueError):
            self._bad_key(kv.key)
            return
        index.set_node(rec)
        if kv.lease:
            leases[kv.lease] = rec.node_id

    def _parse_block_key(self, rest: bytes) -> tuple[str, bytes, int] | None:
        try:
            ns_b, hx, sh = rest.rsplit(b"/", 2)
            h = binascii.unhexlify(hx)
            shard = int(sh)
        except (ValueError, binascii.Error):
            self._bad_key(rest)
            return None
        ns = self._ns_names.get(ns_b)
        if ns is None:
            ns = ns_b.decode(errors="replace")
            if len(self._ns_names) < 100_000:
                self._ns_names[ns_b] = ns
        return ns, h, shard

    def _location(self, leases: dict[int, str], kv: rpc.KeyValue) -> tuple[str, int, bool] | None:
        """``(node id, generation, only on disk)`` of a block key: the node from the
        key's lease when known, else from the value (a
        :class:`~pegaflow.keys.BlockLocation` record)."""
        try:
            v = _unpackb(kv.value)
            gen = v[2]
            node = leases.get(kv.lease) or v[0]
            if len(v) != 5 or type(node) is not str or type(gen) is not int:
                raise ValueError("malformed block location")
            if not 0 <= gen <= GEN_MAX:
                raise ValueError("generation out of range")
        except Exception:
            self.bad_keys += 1
            return None
        return node, gen, v[1] == DISK_SLOT

    def _bad_key(self, key: bytes) -> None:
        if not self.bad_keys:
            log.warning("ignoring malformed index key %r (further ones only counted)", key[:200])
        self.bad_keys += 1
