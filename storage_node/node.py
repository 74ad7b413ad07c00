"""A storage node: pool, block service, its sites and inventory publishing, with one lifecycle.

Start brings up the pool (created, or re-attached from an earlier process), the block
service (:mod:`~pegaflow.storage_node.node_service`), then the sites in front of it (the
same-host control socket, :mod:`~pegaflow.storage_node.local_control`, and UCX,
:mod:`~pegaflow.storage_node.ucx_site`) and membership, in this order; close takes them
down in reverse (membership, the sites, the service, the pool).  A pool that does not
fit the memory or ``shm_dir`` is refused before anything is allocated.  A start that
fails at any step (no space for the pool, a port taken, a bad address, a node id held
by another live node) takes down what it brought up and removes the pool file, journal
and control socket *this start created*; a pool file it found, and was re-attaching, is
left for the next start (and a process killed while preparing a new pool leaves none: see
:mod:`~pegaflow.storage_node.pool`).

Access: with ``[node] access_group`` the pool file and the control socket are given to
that group, mode 0660, so an engine running as another user in the group takes the
same-host path; without, they are owner-only.  UCX's shared-memory transports refuse
peers of other users, so such a node runs with ``UCX_TLS=^shm`` in its environment
(docs/operations.md): same-host data goes through the pool file anyway.

Health: the node is healthy while it can serve: pool mapped, UCX site listening,
the pool file still at its path and of its size (every handshake and same-host client
needs it: a file deleted under the node is reported, and logged once at ERROR; a file
truncated marks the pool failed, see :mod:`~pegaflow.storage_node.pool`), and its node id not
refused by the cluster.  A degraded journal (see :mod:`~pegaflow.storage_node.journal`)
keeps the node healthy, since it serves, but shows in ``/health``, ``/v1/status`` and
the ``pegaflow_node_journal_*`` metrics; so does a degraded disk tier (its directory
gone, its file system full, errors counted lately: ``disk_degraded`` and
``disk_reason`` in ``/health``, ``pegaflow_node_disk_degraded``).  A watchdog
re-checks this every second and lets a degraded journal retry.

Disk tier (``[node] disk_path``, :mod:`~pegaflow.storage_node.disk_tier`): opened right
after the pool and recovered from its records; the pool's generations start above the
largest one on disk.  A block the pool evicts is copied to the tier (written in the
background) and stays published, its location's slot
:data:`~pegaflow.keys.DISK_SLOT`, once written; a spill dropped or failed, or a block the
tier evicts or finds corrupt, is unpublished (unless the pool holds it again).
With ``[node] disk_spill_ahead_bytes`` the pool keeps that much room free by writing
its coldest blocks to the tier ahead of their eviction
(:mod:`~pegaflow.storage_node.spill_ahead`).  At start
each block recovered from the disk and not in the pool is republished under the new
lease, and a background scrub verifies every one of them (one that fails is dropped and
unpublished; every read verifies its block anyway).  A tier that cannot be opened (of
an incompatible format, no space, in use by another node, a path that cannot be made)
is logged at ERROR with what to do, and the node serves from memory only.  It closes
after the sites and the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from pegaflow.storage_node.blocks import BlockKey, Entry, align_up
from pegaflow.storage_node.disk_tier import DiskTier
from pegaflow.storage_node.journal import Journal
from pegaflow.storage_node.local_control import SOCKET_SUFFIX, LocalControl
from pegaflow.storage_node.metrics import DiskCollector, JournalCollector, NodeMetrics
from pegaflow.storage_node.node_service import NodeService
from pegaflow.storage_node.pool import BlockPool
from pegaflow.storage_node.shm_file import apply_access, resolve_group
from pegaflow.storage_node.spill_ahead import SpillAhead, reserve_bytes
from pegaflow.storage_node.ucx_site import UcxSite
from prometheus_client import CollectorRegistry

from pegaflow import __version__
from pegaflow.addresses import settle_node
from pegaflow.auth import Authenticator
from pegaflow.config import NodeConfig
from pegaflow.errors import PegaError
from pegaflow.inventory import InventorySink
from pegaflow.keys import DISK_SLOT, BlockLocation, NodeRecord

log = logging.getLogger(__name__)

_WATCH_S = 1.0


class NullSink:
    """An InventorySink that publishes nowhere (a node without any index)."""

    async def start(self, record: NodeRecord) -> None:
        pass

    async def update_node(self, record: NodeRecord) -> None:
        pass

    def publish(self, ns: str, block_hash: bytes, shard: int, loc: BlockLocation) -> None:
        pass

    def unpublish(self, ns: str, block_hash: bytes, shard: int, loc: BlockLocation) -> None:
        pass

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass


class StorageNode:
    """Owns a :class:`BlockPool`, serves it (a :class:`NodeService` behind its sites)
    and publishes it to a sink.

    ``await start()`` brings everything up in order (pool, service, sites, membership);
    ``await close()`` takes it down in reverse.  ``sink`` decides where the inventory
    goes (etcd in a cluster, the embedded coordinator's index in ``pegaflow-server``);
    ``size_flag`` is the option a refused pool size names.
    """

    def __init__(
        self,
        cfg: NodeConfig,
        sink: InventorySink | None = None,
        *,
        token: str | None = None,
        tenant_tokens: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
        size_flag: str = "--node-pool-bytes",
    ) -> None:
        self.cfg = settle_node(cfg)  # run_service settled it against etcd already
        self.size_flag = size_flag
        self.sink: InventorySink = sink if sink is not None else NullSink()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = NodeMetrics(self.registry)
        self._auth = Authenticator(token, tenant_tokens)
        self.pool: BlockPool | None = None
        self.service: NodeService | None = None
        self.control: LocalControl | None = None
        """the same-host control socket (None: not served)"""
        self.ucx: UcxSite | None = None
        self.node_id = cfg.node_id
        self.started_at = time.time()
        self._stack = contextlib.AsyncExitStack()  # what start brought up, close takes down
        self._aborting = False  # a failed start unwinds: created files go, closes are quiet
        self._unlink = True
        self._reported: str | None = None  # the serving problem logged last
        self._dirty = asyncio.Event()
        self.http_address = ""
        self.disk: DiskTier | None = None
        """the disk tier under the pool (None: off, or it could not be opened)"""
        self._disk_keys: list[BlockKey] = []
        """the blocks recovered from the disk tier at start"""
        self._spill_ahead: SpillAhead | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.registry.register(JournalCollector(self._journal))
        self.registry.register(DiskCollector(self._disk_stats))

    @property
    def ucx_port(self) -> int:
        """The port the UCX site listens on (once started)."""
        assert self.ucx is not None, "the node is not serving"
        return self.ucx.port

    def record(self) -> NodeRecord:
        """This node as published in the index."""
        assert self.pool is not None
        st = self.pool.stats()
        m = self.metrics
        disk = self.disk.stats() if self.disk is not None else None
        return NodeRecord(
            node_id=self.node_id,
            host=self.cfg.host,
            ucx_port=self.ucx_port,
            http=self.http_address,
            capacity_bytes=st.capacity_bytes,
            used_bytes=st.used_bytes,
            blocks=st.blocks,
            started_at=self.started_at,
            version=__version__,
            pool_id=self.pool.pool_id,
            same_host_lookups=int(m.same_host_lookups.value),
            same_host_hit_blocks=int(m.same_host_hit_blocks.value),
            same_host_miss_blocks=int(m.same_host_miss_blocks.value),
            disk_capacity_bytes=disk.capacity_bytes if disk is not None else 0,
            disk_used_bytes=disk.used_bytes if disk is not None else 0,
            disk_blocks=disk.blocks if disk is not None else 0,
            pool_file=self._pool_file_id(),
        )

    def _pool_file_id(self) -> list[Any]:
        """``[path, device, inode]`` of the pool file, published for same-host discovery
        (empty without ``local_access`` or when the file cannot be read)."""
        assert self.pool is not None
        if not self.cfg.local_access or self.pool.file_problem() is not None:
            return []
        return [str(self.pool.path), *self.pool.file_id]

    def _on_evict(self, e: Entry) -> None:
        if self.service is not None:
            self.service.forget(e)
        self.sink.unpublish(e.key[0], e.key[1], e.key[2], e.location(self.node_id))
        self._dirty.set()

    def inventory(self) -> list[tuple[str, bytes, int, BlockLocation]]:
        """Every committed block and every block only on the disk tier, for a full
        republish."""
        assert self.pool is not None
        out = [
            (e.key[0], e.key[1], e.key[2], e.location(self.node_id)) for e in self.pool.committed()
        ]
        if self.disk is not None:
            for key in self.disk.keys():
                loc = self._disk_location(key)
                if loc is not None and self.pool.get(key) is None:
                    out.append((key[0], key[1], key[2], loc))
        return out

    # ---- disk tier -----------------------------------------------------------------

    def _disk_stats(self) -> Any:
        return self.disk.stats() if self.disk is not None else None

    def _disk_location(self, key: BlockKey) -> BlockLocation | None:
        """Where ``key`` is on the disk tier, as published (None: not there)."""
        info = self.disk.info(key) if self.disk is not None else None
        if info is None:
            return None
        return BlockLocation(self.node_id, DISK_SLOT, info.gen, info.length, info.xxh3)

    def _open_disk(self) -> None:
        """Open and recover the disk tier of ``[node] disk_path``, if any; a tier that
        cannot be used is logged with what to do, and the node runs from memory."""
        cfg = self.cfg
        if not cfg.disk_path:
            return
        try:
            disk = DiskTier(
                cfg.disk_path,
                cfg.disk_bytes,
                cfg.disk_block_bytes,
                on_evict=self._disk_evicted,
                on_spilled=self._disk_spilled,
                read_threads=max(1, cfg.disk_read_threads),
                write_threads=max(1, cfg.disk_write_threads),
                queue_depth=max(1, cfg.disk_queue_bytes // align_up(max(1, cfg.disk_block_bytes))),
            )
        except (PegaError, OSError) as e:
            log.error(
                "disk tier %s not used, serving from memory only: %s (fix [node] disk_path / "
                "disk_bytes / disk_block_bytes and restart the node to use it)",
                cfg.disk_path,
                e,
            )
            return
        try:
            keys = disk.recover()
        except (PegaError, OSError) as e:
            disk.close()
            log.error(
                "disk tier %s could not be read (%s), serving from memory only: check the "
                "disk, or remove its pegaflow-disk.* files to start it empty",
                cfg.disk_path,
                e,
            )
            return
        assert self.pool is not None
        self.pool.raise_gen(max((i.gen for k in keys if (i := disk.info(k))), default=0))
        self.disk, self._disk_keys = disk, keys
        reserve = reserve_bytes(cfg.disk_spill_ahead_bytes, self.pool.capacity)
        if reserve:
            self._spill_ahead = SpillAhead(
                self.pool, disk, reserve, self._on_data_loop,
                max_inflight=4 * max(1, cfg.disk_write_threads),
            )  # fmt: skip
        log.info(
            "disk tier %s: %d MiB, %d blocks recovered, %s I/O",
            cfg.disk_path,
            disk.capacity >> 20,
            len(keys),
            "direct" if disk.direct_io else "buffered",
        )

    def _on_spill(self, e: Entry) -> bool:
        """The pool evicts ``e`` (under its lock): copy it to the disk tier; whether it
        stays published (on disk already, or its write queued)."""
        disk = self.disk
        if disk is None:
            return False
        if self.service is not None:
            self.service.forget(e)
        if disk.contains(e.key):  # promoted from there earlier: nothing to write
            loc = self._disk_location(e.key)
            if loc is not None:
                self.sink.publish(e.key[0], e.key[1], e.key[2], loc)
                self._dirty.set()
                return True
        if self.pool is None or self.pool.check_file() is not None:
            return False  # its slot may be past the end of a truncated file
        if disk.spill(e.key, e.gen, self.pool.view(e), e.xxh3):
            self._dirty.set()
            return True
        return False

    def _on_data_loop(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the data loop (the tier calls back on its I/O threads)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(fn, *args)

    def _disk_spilled(self, key: BlockKey, ok: bool) -> None:
        self._on_data_loop(self._spilled, key, ok)

    def _disk_evicted(self, key: BlockKey) -> None:
        self._on_data_loop(self._spilled, key, False)

    def _spilled(self, key: BlockKey, on_disk: bool) -> None:
        """A spill of ``key`` was written (``on_disk``) or failed, or the tier dropped
        it: publish where it is now, unless the pool holds it again (a reservation
        does not count: a promotion whose read failed is aborted right after this)."""
        if self.pool is None or self.pool.get(key) is not None:
            return
        loc = self._disk_location(key) if on_disk else None
        if loc is not None:
            self.sink.publish(key[0], key[1], key[2], loc)
        else:
            self.sink.unpublish(key[0], key[1], key[2], BlockLocation(self.node_id, 0, 0, 0, 0))
        self._dirty.set()

    @property
    def pool_created(self) -> bool:
        """Whether this node's start created its pool file (so a failure removes it)."""
        return self.pool is not None and self.pool.created

    async def start(self) -> None:
        """Bring up pool, service, sites and membership; on failure, take down what came
        up and remove a pool file this start created (see the module docstring)."""
        self._stack = contextlib.AsyncExitStack()
        try:
            await self._start()
        except BaseException:
            self._aborting = True
            try:
                await self._stack.aclose()
            finally:
                self._aborting = False
            raise

    def _on_close(self, name: str, close: Callable[[], Awaitable[None] | None]) -> None:
        """Put ``close`` on the stack (while a failed start unwinds, its failure is logged)."""

        async def run() -> None:
            try:
                result = close()
                if result is not None:
                    await result
            except Exception:
                if not self._aborting:
                    raise
                log.warning("closing %s failed", name, exc_info=True)

        self._stack.push_async_callback(run)

    async def _close_part(self, attr: str) -> None:
        """Close the site or service at ``self.<attr>`` (if any), and forget it."""
        part = getattr(self, attr)
        setattr(self, attr, None)
        if part is not None:
            await part.close()

    def _close_pool(self) -> None:
        """Close the pool; its file goes with ``close(unlink=True)`` or a failed start."""
        pool, self.pool = self.pool, None
        if pool is None:
            return
        pool.close(unlink=pool.created if self._aborting else self._unlink)
        if self._aborting and pool.created:
            log.info("start failed: removed %s, which it had created", pool.path)

    async def _start(self) -> None:
        cfg = self.cfg
        if not self.node_id:
            if cfg.ucx_port:
                self.node_id = f"{socket.gethostname()}-{cfg.ucx_port}"
            else:  # a port picked by the OS says nothing stable: make the id unique
                self.node_id = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
                log.warning(
                    "no [node] node_id and ucx_port 0: using %s; set node_id so that a "
                    "restart finds this pool again",
                    self.node_id,
                )
        self._loop = asyncio.get_running_loop()
        gid = resolve_group(cfg.access_group)
        path = Path(cfg.shm_dir) / f"pegaflow-{self.node_id}.pool"
        self._on_close("the pool", self._close_pool)
        self.pool = await BlockPool.opened(
            path,
            cfg.pool_bytes,
            cfg.slab_bytes,
            node_id=self.node_id,
            on_evict=self._on_evict,
            on_spill=self._on_spill,
            fresh=cfg.fresh_pool,
            access_gid=gid,
            size_flag=self.size_flag,
        )
        self._on_close("the disk tier", self._close_disk)
        self._open_disk()
        self.update_gauges()  # capacity is known now, not only after the first change
        self.service = NodeService(
            self.pool, cfg, self.sink, self.metrics, on_change=self._dirty.set, disk=self.disk
        )
        self._on_close("the service", lambda: self._close_part("service"))
        await self.service.start()
        control = None
        if cfg.local_access:
            self._on_close("the control socket", lambda: self._close_part("control"))
            self.control = LocalControl(
                self.service,
                str(path) + SOCKET_SUFFIX,
                self._auth,
                cfg.max_request_bytes,
                self.metrics,
            )
            if await self.control.start():
                control = self.control.path
            else:
                self.control = None
        self._on_close("the UCX site", lambda: self._close_part("ucx"))
        self.ucx = UcxSite(self.service, cfg, self.metrics, self._auth, control_path=control)
        await self.ucx.start()
        if gid is not None:  # before the node is published to anyone
            if (sock := Path(str(path) + SOCKET_SUFFIX)).is_socket():  # if served
                apply_access(sock, gid)
            log.info("pool file and control socket open to group %s (mode 0660)", cfg.access_group)
        if not cfg.node_id and cfg.ucx_port == 0:
            log.info("node id %s (set [node] node_id to keep it stable)", self.node_id)
        self._on_close("the sink", self.sink.close)
        await self.sink.start(self.record())
        if self.pool.recovered:
            for e in self.pool.recovered:
                self.sink.publish(e.key[0], e.key[1], e.key[2], e.location(self.node_id))
            log.info("re-attached %d verified blocks from %s", len(self.pool.recovered), path)
            self.update_gauges()
        self._publish_disk()
        for loop in (self._refresh_loop(), self._watch_loop()):
            self._stack.push_async_callback(_cancel, asyncio.create_task(loop))
        log.info(
            "node %s serving %d MiB on UCX %s:%d",
            self.node_id,
            self.pool.capacity >> 20,
            cfg.host,
            self.ucx_port,
        )

    def _publish_disk(self) -> None:
        """Republish the blocks recovered from the disk tier and not in the pool, then
        verify them all in the background (one that fails is dropped, unpublished)."""
        disk, keys, self._disk_keys = self.disk, self._disk_keys, []
        if disk is None or self.pool is None:
            return
        n = 0
        for key in keys:
            loc = self._disk_location(key)
            if loc is not None and self.pool.get(key) is None:
                self.sink.publish(key[0], key[1], key[2], loc)
                n += 1
        if n:
            log.info("republished %d blocks from the disk tier %s", n, disk.path)
        t0 = time.perf_counter()

        def scrubbed(f: Any) -> None:
            bad = f.result()
            level = logging.WARNING if bad else logging.INFO
            log.log(level, "disk tier %s verified in %.1f s: %d blocks failed their checksum "
                    "and were dropped", disk.path, time.perf_counter() - t0, len(bad))  # fmt: skip

        if keys:
            disk.scrub().add_done_callback(scrubbed)

    async def _refresh_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            self.update_gauges()
            try:
                await self.sink.update_node(self.record())
            except Exception:
                log.warning("could not refresh the node record", exc_info=True)
            await asyncio.sleep(1.0)

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_S)
            if self.pool is None:
                continue
            self.problem()
            try:
                self.pool.maintain_journal()
            except Exception:
                log.exception("journal maintenance failed")

    def update_gauges(self) -> None:
        assert self.pool is not None
        st = self.pool.stats()
        m = self.metrics
        m.capacity_bytes.set(st.capacity_bytes)
        m.used_bytes.set(st.used_bytes)
        m.blocks.set(st.blocks)
        m.evictions.set(st.evictions)

    def problem(self) -> str | None:
        """Why this node cannot serve as it should (see the module docstring), else
        None.  A new problem is logged once, at ERROR."""
        problem: str | None
        if self.pool is None or self.ucx is None:
            problem = "not serving (starting or stopped)"
        elif (why := self.pool.check_file()) is not None:
            problem = why
        elif (why := self.pool.file_problem()) is not None:
            problem = (
                f"{why}: new connections cannot complete their handshake and same-host "
                "clients cannot map the pool; restart the node (the blocks in the pool "
                "are lost with the file)"
            )
        else:
            problem = getattr(self.sink, "refused", None)
        if problem is not None and problem != self._reported and self.ucx is not None:
            log.error("node %s unhealthy: %s", self.node_id, problem)
        self._reported = problem
        return problem

    def _journal(self) -> Journal | None:
        return self.pool.journal if self.pool is not None else None

    def _journal_status(self) -> dict[str, Any] | None:
        j = self._journal()
        if j is None:
            return None
        return {
            "degraded": j.degraded,
            "bad_records": j.bad_records,
            "torn_tail": j.torn_tail,
            "write_errors": j.write_errors,
            "unjournaled": j.unjournaled,
        }

    async def status(self) -> dict[str, Any]:
        """The /v1/status document of this node."""
        assert self.pool is not None
        problem = self.problem()
        return {
            "node": self.record().to_wire(),
            "pool": vars(self.pool.stats()),
            "journal": self._journal_status(),
            "disk": vars(self.disk.stats()) if self.disk is not None else None,
            "health": {"ok": problem is None, "reason": problem},
        }

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy while the node can serve (see the module docstring); the body says
        why not (``reason``) and whether the journal is degraded."""
        problem = self.problem()
        body: dict[str, Any] = {"node_id": self.node_id, "serving": problem is None}
        if problem is not None:
            body["reason"] = problem
        journal = self._journal_status()
        if journal is not None:
            body["journal_degraded"] = journal["degraded"]
        if self.disk is not None:  # the node serves from memory: degraded, not down
            disk_problem = self.disk.problem()
            body["disk_degraded"] = disk_problem is not None
            if disk_problem is not None:
                body["disk_reason"] = disk_problem
        return problem is None, body

    async def close(self, unlink: bool = True) -> None:
        """Stop: take down what :meth:`start` brought up, in reverse; ``unlink`` also
        removes the pool file and its journal."""
        self._unlink = unlink
        await self._stack.aclose()

    async def close_at_exit(self, failed: bool) -> None:
        """Close as the process ends: the pool file stays with ``[node] keep_pool``, and
        goes after a start that ``failed`` if that start created it."""
        await self.close(unlink=self.pool_created if failed else not self.cfg.keep_pool)

    def _close_disk(self) -> None:
        """Close the disk tier (after the sites: its queued spills are written first)."""
        disk, self.disk = self.disk, None
        if self._spill_ahead is not None:
            self._spill_ahead.close()
        if disk is not None:
            disk.close()


async def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for it to end."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
