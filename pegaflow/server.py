"""``pegaflow-server``: the single-host, all-in-one default.

One process runs a coordinator and a storage node, speaking the same protocols as a
cluster: clients and vLLM connectors point at it exactly as at a coordinator.  Without
``--etcd-endpoints`` the node feeds the coordinator's index in-process (no etcd, the
index lives as long as the process); with them, both use etcd like a cluster.

One HTTP endpoint (the coordinator's) serves ``/health``, ``/metrics`` (coordinator and
node metrics) and ``/v1/status``.  Prints
``READY coordinator=<host:port> node=<id> ucx=<host:port> http=<port> pool=<bytes>``
once serving.

The pool fits a GPU host unless given (``--pool-size`` or ``--node-pool-bytes``, e.g.
``40GiB``): min(25% of the host's memory, 50% of the size of ``[node] shm_dir``, 64 GiB),
in whole slabs, and never more than half of the memory available and the space free in
``shm_dir`` at start (the pool is backed by memory as it starts).  64 GiB holds about
fifty 10,000-token Llama-3.1-8B prompts (1.31 GB of KV each).  The sizes are totals,
not what is free, so a restart finds its pool file the same size and re-attaches it.
A pool given larger than the memory available or the space free in ``shm_dir`` is
refused at start with the sizes (exit status 2), before anything is allocated.

The pool survives the server's own restarts: a clean stop keeps the pool file and its
journal (``[node] keep_pool``), and the next start re-attaches the blocks whose bytes
still match their checksums, as ``pegaflow-node`` does.  This needs a stable node id,
which the default gives (``<hostname>-<ucx port>``; set ``--node-id`` with
``--node-ucx-port 0``).  ``--fresh-pool`` starts empty instead, ``--node-keep-pool
false`` removes the pool at exit.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from pegaflow.auth import cluster_token, tenant_tokens
from pegaflow.config import ArgParser, ClusterConfig, parse_bool, parse_size
from pegaflow.coordinator.index import BlockIndex
from pegaflow.coordinator.inprocess_sink import InProcessSink
from pegaflow.coordinator.service import Coordinator
from pegaflow.inventory import InventorySink
from pegaflow.observability.http import new_registry
from pegaflow.runner import Runner, run_service
from pegaflow.storage_node.shm_file import PoolDoesNotFit, PoolInUse, memory_available
from pegaflow.transport.loopthread import LoopThread
from pegaflow.units import human_bytes

log = logging.getLogger("pegaflow.server")

AUTO_POOL_CAP = 64 << 30
"""the largest pool pegaflow-server picks by itself"""
AUTO = "auto"
PROG = "pegaflow-server"


@dataclass(frozen=True)
class HostMemory:
    """What sizes the default pool: the host's memory and ``shm_dir``'s filesystem."""

    mem_total: int
    mem_available: int
    shm_total: int
    shm_free: int

    @classmethod
    def read(cls, shm_dir: str) -> HostMemory:
        """This host's figures (``/proc/meminfo`` and ``statvfs(shm_dir)``)."""
        info: dict[str, int] = {}
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    key, _, rest = line.partition(":")
                    info[key] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        st = os.statvfs(shm_dir)
        return cls(
            mem_total=total,
            mem_available=memory_available()[0],
            shm_total=st.f_blocks * st.f_frsize,
            shm_free=st.f_bavail * st.f_frsize,
        )


def auto_pool_bytes(host: HostMemory, slab_bytes: int) -> tuple[int, str]:
    """The default pool size for ``host`` in whole slabs, and how it was chosen.

    min(25% of the memory, 50% of shm_dir's size, :data:`AUTO_POOL_CAP`), from totals so
    that it is the same at every start; clamped to half of what is available and free
    right now (a pool backed by memory that is not there would crash the node later).
    0 when not even one slab fits.
    """
    want = min(host.mem_total // 4, host.shm_total // 2, AUTO_POOL_CAP)
    why = (
        f"min(25% of {human_bytes(host.mem_total)} memory, 50% of {human_bytes(host.shm_total)} "
        f"shm_dir, {human_bytes(AUTO_POOL_CAP)})"
    )
    room = min(host.mem_available // 2, host.shm_free // 2)
    if want > room:
        want = room
        why += (
            f", cut to half of what is available now ({human_bytes(host.mem_available)} memory, "
            f"{human_bytes(host.shm_free)} free in shm_dir)"
        )
    return want // slab_bytes * slab_bytes, why


def _size_pool(cfg: ClusterConfig) -> ClusterConfig:
    """``cfg`` with the default pool size (``[node] pool_bytes`` 0) decided; says what it is."""
    node = cfg.node
    if node.pool_bytes:
        log.info("pool of %s (given) in %s", human_bytes(node.pool_bytes), node.shm_dir)
        return cfg
    size, why = auto_pool_bytes(HostMemory.read(node.shm_dir), node.slab_bytes)
    if size <= 0:
        log.error(
            "cannot size the pool by itself: %s leaves less than one slab (%s); give "
            "--pool-size (e.g. 4GiB) or a larger --node-shm-dir",
            why,
            human_bytes(node.slab_bytes),
        )
        raise SystemExit(2)
    log.info(
        "pool of %s in %s (auto: %s; --pool-size sets it)", human_bytes(size), node.shm_dir, why
    )
    return replace(cfg, node=replace(node, pool_bytes=size))


def _aliases(argv: list[str]) -> list[str]:
    """PegaFlow's own spelling ``--pool-size SIZE`` for ``--node-pool-bytes`` (and
    ``auto`` for the default); ``--fresh-pool[=BOOL]`` for ``--node-fresh-pool``.  A bad
    value is an error naming the flag as given."""
    out: list[str] = []
    it = iter(argv)
    for a in it:
        flag, eq, value = a.partition("=")
        if flag in ("--pool-size", "--node-pool-bytes"):
            if not eq:
                value = next(it, None) or _bad_alias(flag, "expected one argument")
            auto = value.strip().lower() == AUTO
            _check_alias(flag, value, parse_size, auto)
            out += ["--node-pool-bytes", "0" if auto else value]
        elif flag == "--fresh-pool":
            value = value if eq else "true"
            _check_alias(flag, value, parse_bool)
            out += ["--node-fresh-pool", value]
        else:
            out.append(a)
    return out


def _check_alias(flag: str, value: str, parse: Callable[[str], Any], ok: bool = False) -> None:
    """Exit with status 2 naming ``flag`` unless ``value`` parses (or ``ok``)."""
    if ok:
        return
    try:
        parse(value)
    except ValueError as e:
        _bad_alias(flag, str(e))


def _bad_alias(flag: str, problem: str) -> NoReturn:
    ArgParser(prog=PROG).error(f"argument {flag}: {problem}")


class AllInOne:
    """A coordinator and a storage node in one process, with one lifecycle.

    The coordinator runs on an event loop of its own (:class:`LoopThread`): lookups do
    not queue behind the node's bulk transfers on one loop.  Without etcd the node
    feeds the coordinator's index through an :class:`InProcessSink` that hands every change
    to that loop."""

    def __init__(self, cfg: ClusterConfig) -> None:
        # imported here, not at the top: without ucxx, --help works and a start fails in
        # one line naming the extra to install (UcxNotInstalled)
        from pegaflow.storage_node.node import StorageNode

        self.cfg = cfg
        self.registry = new_registry()
        self._use_etcd = bool(cfg.etcd.endpoints)
        self._control = LoopThread("pegaflow-coordinator")
        self.coordinator: Coordinator | None = None
        self.node = StorageNode(
            cfg.node,
            token=cluster_token(cfg.security),
            tenant_tokens=tenant_tokens(cfg.security),
            registry=self.registry,
            size_flag="--pool-size",
        )

    async def _make_coordinator(self) -> Coordinator:
        cfg = self.cfg
        return Coordinator(
            cfg.coordinator,
            etcd=cfg.etcd if self._use_etcd else None,
            security=cfg.security,
            index=None if self._use_etcd else BlockIndex(),
            registry=self.registry,
        )

    async def start(self, run: Runner) -> None:
        """Start the coordinator, then the node, each entered into ``run``'s stack."""
        self._control.start()
        run.stack.callback(self._control.stop)
        self.coordinator = coord = await self._control.run(self._make_coordinator())
        sink: InventorySink
        if self._use_etcd:
            from pegaflow.storage_node.publisher import EtcdPublisher

            sink = EtcdPublisher(self.cfg.etcd, self.node.inventory, registry=self.registry)
        else:
            sink = InProcessSink(coord.index, owner=self._control)
        self.node.sink = sink
        await run.enter(
            self._control.run(coord.start()), lambda _: self._control.run(coord.close())
        )
        if coord.http_port is not None:
            self.node.http_address = f"{coord.config.http_host}:{coord.http_port}"
        await run.enter(self.node.start(), self.node.close_at_exit)

    def ready_line(self) -> str:
        """``READY coordinator=... node=... ucx=... http=... pool=...`` (once started)."""
        assert self.coordinator is not None
        http: Any = self.coordinator.http_port if self.coordinator.http_port is not None else -1
        pool = self.node.pool.capacity if self.node.pool is not None else 0
        return (
            f"READY coordinator={self.coordinator.address} node={self.node.node_id} "
            f"ucx={self.node.cfg.host}:{self.node.ucx_port} http={http} pool={pool}"
        )


async def start(cfg: ClusterConfig, run: Runner) -> str:
    """Size the pool, start the coordinator and the node; the READY line."""
    cfg = _size_pool(cfg)
    server = AllInOne(cfg)
    run.telemetry(server.registry)
    try:
        await server.start(run)
    except (PoolDoesNotFit, PoolInUse, PermissionError, ValueError) as e:
        run.fail("cannot start: %s", e)
    except OSError as e:
        c, n = cfg.coordinator, cfg.node
        run.fail_on_ports("cannot start", e, [
            (c.host, c.port, "--coordinator-port"),
            (c.http_host, c.http_port, "--coordinator-http-port"),
            (n.host, n.ucx_port, "--node-ucx-port"),
        ])  # fmt: skip
    return server.ready_line()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pegaflow-server``."""
    run_service(
        PROG,
        __doc__,
        ["etcd", "security", "coordinator", "node", "telemetry"],
        start,
        _aliases(sys.argv[1:] if argv is None else argv),
        defaults={"node": {"pool_bytes": 0}},
    )


if __name__ == "__main__":
    main()
