#!/usr/bin/env python3
"""Chaos: a cluster under load while its processes are faulted at random.

On this machine only (loopback): a real etcd, ``--coordinators`` coordinators and
``--nodes`` storage nodes (small pools, constant eviction), all real processes, and
``--workers`` client processes (``scripts/chaos_worker.py``) with ``--tasks``
concurrent tasks each, doing puts, lookups and gets through
:class:`pegaflow.client.PegaClient`.  Every block's bytes are
derived from its hash, so every byte a get reports as fetched is checked.

Meanwhile, every 1-4 s, one process is faulted at random:

* ``stop``: SIGSTOP, then SIGCONT after 0.5-5 s (a hung host; unlike ``kill`` the
  kernel keeps its sockets open), on a node, a coordinator, etcd or a client worker
  (a hung reader, for the node side);
* ``kill``: SIGKILL, then a restart after 0-1.5 s on the same ports (a node on the same
  node id and pool directory: it re-attaches its pool), on any of them (a client
  killed mid-transfer is what a crashed vLLM engine does to the nodes);
* ``replace`` (nodes): SIGKILL, the node's pool directory emptied (pool file, journal,
  control socket), then a restart on the same node id, path and ports with a fresh
  empty pool: a cleaned /dev/shm, a new emptyDir.  Its old blocks must be misses;
* ``move`` (nodes): SIGKILL, then a restart on the same node id and pool but new UCX
  and HTTP ports (a pod rescheduled with a new address): clients must find it at its
  new address through the coordinators' records.

``--first-faults replace,move`` makes those the first faults of the run (the smoke test
reaches every kind that way); the others are drawn with the odds of
:data:`FAULT_KINDS`.  The last ``--cooldown`` seconds have no faults: what fails then
is still broken.

Checks:

* **wrong bytes**: a block a get reported fetched (True) whose bytes differ from its
  hash's, checked when the get returns; **late writes**: a buffer that changed after
  its get returned (checked again before the buffer is reused, as vLLM's connector
  reuses its staging buffers: a block verified then overwritten counts as wrong bytes);
* **served after replace**: a block a get started after a ``replace`` reported fetched
  from the replaced node although its put returned before the pool was emptied;
* **nodes lost by clients**: a client that never again stored on or fetched from a node
  after a fault on it, though the load went on for :data:`REACH_S` or more;
* **stall**: how far past its deadline each client call returned (measured by the
  caller, and from outside for calls that have not returned yet);
* **loop freeze**: the lateness of a 20 ms ticker on each client's event loop, and the
  gap between its heartbeats seen from outside;
* **recovery**, per fault: the time from the fault's end (SIGCONT sent, or the
  restarted process ready) to the first successful op against that target (a put or
  get on that node, a lookup answered by that coordinator, a lookup hitting a block
  stored after etcd came back, any op of that client), (nodes) to a successful op on
  it by every client, to its ``/health`` answering and (coordinators) to a lookup sent
  to it alone hitting a recently stored block; summed up per kind of fault and process
  in ``recovery_by_kind``.

Also reported: errors by kind and typed code (and those of the quiet end, by target),
processes that died on their own (restarted; a SIGKILL from outside, such as the OOM
killer of a shared machine, is listed apart) and failure lines in every process's log.

A line per fault goes to stderr as it happens; the last line of stdout is one JSON
object (``wrong_bytes`` and ``served_after_replace`` must be 0, ``nodes_lost_by_clients``
empty, ``max_stall_ms`` under 1000).  Exit status: 0 when these hold and nothing wrote
into a returned buffer, 1 otherwise, 2 when the cluster could not start, 130 on Ctrl-C
(every process and temporary directory is cleaned up).

    .venv/bin/python scripts/chaos.py --minutes 2 --seed 1 [--tls tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "scripts" / "chaos_worker.py"
sys.path.insert(0, str(REPO))

from pegaflow.tools.devcluster import (  # noqa: E402
    EtcdServer,
    Proc,
    free_port,
    start_coordinator,
    start_node,
)
from scripts import _common  # noqa: E402
from scripts._common import log  # noqa: E402
from scripts.chaos_worker import (  # noqa: E402
    DEADLINES_S,
    KIND_CODES,
    NS,
    TICK_S,
    TRANSFER_DEADLINE_S,
)

PREFIX = "/pegaflow/chaos"
BLOCK_KIB = 128
BATCH = 8
STALL_LIMIT_S = 1.0
KIND_NAMES = {v: k for k, v in KIND_CODES.items()}
TARGETS = {"nodes": "node", "coordinators": "coordinator", "etcd": "etcd", "clients": "client"}
"""what ``--targets`` names, and the kind of process each is"""
FAULT_KINDS: dict[str, dict[str, float]] = {
    "node": {"stop": 0.4, "kill": 0.2, "replace": 0.2, "move": 0.2},
    "coordinator": {"stop": 0.6, "kill": 0.4},
    "etcd": {"stop": 0.6, "kill": 0.4},
    "client": {"stop": 0.6, "kill": 0.4},
}
"""the faults each kind of process gets, and their odds (``replace``, ``move``: nodes)"""
RESTART_FOR_S = 30.0
"""how long a restart is retried (a restarted node may be refused while its old lease lives)"""
REACH_S = 8.0
"""a client that never had a successful op on a node again after a fault on it, though
the load went on this long after the fault ended, has lost the node (a failure)"""
REATTACHED = re.compile(r"re-attached (\d+) verified blocks")
"""the line of a node's log that counts the blocks it found in its pool file at start"""


# ---- orchestrator ----------------------------------------------------------------


@dataclass
class Service:
    """A faultable process of the cluster (etcd, a coordinator, a node or a client)."""

    name: str
    kind: str
    """etcd, coordinator, node or client"""
    port: int = 0
    http_port: int = 0
    shm_dir: str = ""
    index: int = 0
    """(clients) the worker's row in the heartbeat array"""
    proc: Proc | None = None
    popen: subprocess.Popen[bytes] | None = None
    """(clients)"""
    expected_down: bool = False
    stopped: bool = False
    crashed: bool = False
    """(clients) died on their own: restarted by the fault loop"""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Fault:
    """One fault: ``stop`` (SIGSTOP for ``hold_s``), or ``kill``, ``replace`` or ``move``
    (SIGKILL and restart; see the module docstring)."""

    kind: str
    target: str
    start: float
    end: float = 0.0
    hold_s: float = 0.0
    restart_attempts: int = 0
    restart_error: str = ""
    recover_s: float | None = None
    probe_s: float | None = None
    index_s: float | None = None
    """(coordinators) until a lookup sent to it hit a block stored recently"""
    every_client_s: float | None = None
    """(nodes) until every client had a good op on it"""
    moved_to: str = ""
    """(move) the node's new UCX address"""
    reattached: int | None = None
    """(nodes restarted) blocks the new process re-attached from the pool file"""


@dataclass
class Tally:
    """Everything the workers reported, folded as it comes (monitor thread only)."""

    ops: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    error_times: list[tuple[float, str, str]] = field(default_factory=list)
    """(when, kind:code, target)"""
    blocks: Counter[str] = field(default_factory=Counter)
    wrong_bytes: int = 0
    late_writes: int = 0
    bad_events: list[dict[str, Any]] = field(default_factory=list)
    stall_by_kind: dict[str, float] = field(default_factory=dict)
    stalls: list[dict[str, Any]] = field(default_factory=list)
    """calls that returned past the limit"""
    inflight_overdue: dict[str, Any] = field(default_factory=dict)
    """the worst call seen from outside still running past its deadline"""
    freezes: list[dict[str, Any]] = field(default_factory=list)
    max_freeze_ms: float = 0.0
    max_beat_gap_ms: float = 0.0
    ok_times: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """when successful ops returned, by target (a node, a coordinator's address), by
    client (``w0``) and by node and client (``n1@w0``)"""
    fresh_hits: list[tuple[float, float]] = field(default_factory=list)
    """(put returned, lookup returned) of lookups that hit a block"""
    excluded_calls: int = 0
    """calls of a worker that was itself SIGSTOPped meanwhile"""
    slowest: dict[str, float] = field(default_factory=dict)
    """longest call of each kind, whatever its deadline"""
    orchestrator_lag_ms: float = 0.0
    """the monitor thread's own worst lateness: the machine's contention, not a defect"""
    recent_puts: list[bytes] = field(default_factory=list)
    """first hash of the latest stored batches (for the coordinators' index probe)"""
    served_after_replace: int = 0
    """blocks fetched from a replaced node that were stored there before its pool went"""


def _server_flags(svc: Service, port_flag: str) -> list[str]:
    """A coordinator's or node's command-line flags: its ports (``port_flag``, and its
    HTTP port) and a short etcd deadline."""
    return [
        port_flag, str(svc.port),
        f"--{svc.kind}-http-port", str(svc.http_port),
        "--etcd-timeout-s", "2",
    ]  # fmt: skip


class Chaos:
    """Starts the cluster and the workers, applies faults, gathers the report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.seed = args.seed if args.seed is not None else random.randrange(1 << 31)
        self.rng = random.Random(self.seed)
        self.tmp = Path(tempfile.mkdtemp(prefix="pegaflow-chaos-"))
        shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.shm = Path(tempfile.mkdtemp(prefix="pegaflow-chaos-", dir=shm_root))
        self.env = {"UCX_TLS": "tcp"} if args.tls == "tcp" else {}
        self.etcd = EtcdServer(self.tmp / "etcd" / "data")
        self.services: dict[str, Service] = {}
        self.workers: list[Service] = []
        self.faults: list[Fault] = []
        self.crashes: list[dict[str, Any]] = []
        self.pauses: dict[int, list[list[float]]] = defaultdict(list)
        self.tally = Tally()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.t0 = time.monotonic()
        self.load_start = 0.0
        self.quiet_from = 0.0
        self.load_end = 0.0
        self.hung_workers: list[str] = []
        self.stopping = False
        self.log_findings: dict[str, dict[str, int]] = {}
        self.pids: list[int] = []
        """every process started (the smoke test checks that none is left)"""
        self.loadavg_start = [round(x, 2) for x in os.getloadavg()]
        self.interrupted = False
        self.error = ""
        self._offsets: dict[int, int] = {}
        self._pending: list[Fault] = []
        self._first: list[str] = [k for k in args.first_faults.split(",") if k]
        """the kinds of ``--first-faults`` not applied yet"""
        self._beats: np.ndarray | None = None
        self._monitor: threading.Thread | None = None

    def rel(self, t: float) -> float:
        """Seconds since the load started."""
        return round(t - (self.load_start or self.t0), 3)

    # -- processes --------------------------------------------------------------------

    def start_cluster(self) -> None:
        self.services["etcd"] = Service("etcd", "etcd", port=self.etcd.client_port)
        self._start(self.services["etcd"])
        for i in range(self.args.coordinators):
            svc = Service(f"c{i + 1}", "coordinator", port=free_port(), http_port=free_port())
            self.services[svc.name] = svc
            self._start(svc)
        for i in range(self.args.nodes):
            svc = Service(
                f"n{i + 1}",
                "node",
                port=free_port(),
                http_port=free_port(),
                shm_dir=str(self.shm / f"n{i + 1}"),
            )
            os.makedirs(svc.shm_dir)
            self.services[svc.name] = svc
            self._start(svc)
        asyncio.run(self._wait_nodes_indexed(60.0))

    def _coordinators(self) -> list[Service]:
        return [s for s in self.services.values() if s.kind == "coordinator"]

    def _nodes(self) -> list[Service]:
        return [s for s in self.services.values() if s.kind == "node"]

    async def _wait_nodes_indexed(self, timeout: float) -> None:
        from pegaflow.transport.rpc_client import RpcClient

        want = {s.name for s in self._nodes()}
        for c in self._coordinators():
            rpc = RpcClient([c.address], timeout=2.0)
            deadline = time.monotonic() + timeout
            try:
                while True:
                    with contextlib.suppress(Exception):
                        res = await rpc.call("nodes", {})
                        if want <= {n.get("node_id") for n in res.get("nodes", [])}:
                            break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"coordinator {c.name} does not see nodes {want}")
                    await asyncio.sleep(0.2)
            finally:
                await rpc.close()

    def _start(self, svc: Service) -> None:
        """(Re)start ``svc`` on its ports; raises RuntimeError if it does not come up."""
        try:
            self._start_once(svc)
        finally:
            pid = self.pid(svc)
            if pid is not None:
                self.pids.append(pid)

    def _start_once(self, svc: Service) -> None:
        if svc.kind == "client":
            self._spawn_worker(svc)
            self._wait_worker(svc, 60.0)
        elif svc.kind == "etcd":
            self.etcd.start()
        elif svc.kind == "coordinator":
            svc.proc = start_coordinator(
                etcd=self.etcd.endpoint,
                prefix=PREFIX,
                env=self.env,
                extra=_server_flags(svc, "--coordinator-port"),
            )
        elif svc.kind == "node":
            svc.proc = start_node(
                svc.name,
                etcd=self.etcd.endpoint,
                prefix=PREFIX,
                pool=self.args.pool,
                slab=self.args.slab,
                env=self.env,
                shm_dir=svc.shm_dir,
                extra=_server_flags(svc, "--node-ucx-port"),
            )

    def pid(self, svc: Service) -> int | None:
        if svc.kind == "etcd":
            p = self.etcd._proc  # EtcdServer keeps its Popen private
            return p.pid if p is not None and p.poll() is None else None
        if svc.kind == "client":
            return svc.popen.pid if svc.popen and svc.popen.poll() is None else None
        return svc.proc.pid if svc.proc is not None and svc.proc.alive() else None

    def _kill(self, svc: Service) -> None:
        if svc.kind == "etcd":
            self.etcd.kill()
        elif svc.kind == "client":
            if svc.popen is not None and svc.popen.poll() is None:
                svc.popen.kill()
                svc.popen.wait(10)
            if self._beats is not None:  # its calls in flight died with it
                self._beats[svc.index, :] = 0.0
        elif svc.proc is not None:
            svc.proc.kill()

    def _log_tail(self, svc: Service, lines: int = 15) -> list[str]:
        if svc.kind == "etcd":
            return self.etcd.tail(lines).splitlines()
        if svc.kind == "client":
            try:
                text = (self.tmp / f"{svc.name}.log").read_text(errors="replace")
            except OSError:
                return []
            return text.splitlines()[-lines:]
        return list(svc.proc.log[-lines:]) if svc.proc is not None else []

    def start_workers(self) -> None:
        n, k = self.args.workers, self.args.tasks
        beats_path = self.tmp / "beats.bin"
        self._beats = np.memmap(beats_path, dtype=np.float64, mode="w+", shape=(n, 1 + 2 * k))
        coords = [c.address for c in self._coordinators()]
        for i in range(n):
            cfg = {
                "index": i,
                "workers": n,
                "tasks": k,
                "seed": self.seed,
                "think_s": self.args.think_ms / 1e3,
                "block_kib": self.args.block_kib,
                "batch": self.args.batch,
                # each worker starts on another coordinator, fails over to the others
                "coordinators": coords[i % len(coords) :] + coords[: i % len(coords)],
                "nodes": [s.name for s in self._nodes()],
                "events": str(self.tmp / f"w{i}.jsonl"),
                "beats": str(beats_path),
            }
            (self.tmp / f"w{i}.json").write_text(json.dumps(cfg))
            svc = Service(f"w{i}", "client", index=i)
            self.services[svc.name] = svc
            self.workers.append(svc)
            self._spawn_worker(svc)
        for svc in self.workers:
            self._wait_worker(svc, 60.0)

    def _spawn_worker(self, svc: Service) -> None:
        assert self._beats is not None
        self._beats[svc.index, :] = 0.0
        with open(self.tmp / f"{svc.name}.log", "ab") as logf:
            svc.popen = subprocess.Popen(
                [sys.executable, str(WORKER), str(self.tmp / f"{svc.name}.json")],
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                cwd=REPO,
                start_new_session=True,  # Ctrl-C reaches the orchestrator, which stops them
            )  # fmt: skip

    def _wait_worker(self, svc: Service, timeout: float) -> None:
        """Until the worker's ticker runs (its client is made)."""
        assert self._beats is not None and svc.popen is not None
        deadline = time.monotonic() + timeout
        while not self._beats[svc.index, 0] > 0:
            if svc.popen.poll() is not None:
                raise RuntimeError(
                    f"client {svc.name} exited at start:\n" + "\n".join(self._log_tail(svc, 30))
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"client {svc.name} not started in {timeout:.0f} s")
            time.sleep(0.05)

    # -- the run ------------------------------------------------------------------------

    def run(self) -> None:
        seconds = self.args.minutes * 60
        cooldown = _common.cooldown_s(self.args, seconds, most_s=10.0)
        self.load_start = time.monotonic()
        self.load_end = self.load_start + seconds
        self.quiet_from = self.load_end - cooldown / 2
        faults_until = self.load_end - cooldown
        self._monitor = threading.Thread(target=self._monitor_loop, name="monitor", daemon=True)
        self._monitor.start()
        log(
            f"chaos: seed {self.seed}, {seconds:.0f} s ({cooldown:.0f} s without faults at the "
            f"end), UCX_TLS={self.env.get('UCX_TLS', 'default')}, {len(self.workers)} clients x "
            f"{self.args.tasks} tasks, {len(self._coordinators())} coordinators, "
            f"{len(self._nodes())} nodes"
        )
        time.sleep(min(2.0, cooldown))  # some blocks stored before the first fault
        while True:
            self._restart_crashed()
            wait = self.rng.uniform(1.0, 4.0)
            if time.monotonic() + wait >= faults_until:
                break
            time.sleep(wait)
            self._fault()
        while time.monotonic() < self.load_end:
            self._restart_crashed()
            time.sleep(min(0.5, max(0.0, self.load_end - time.monotonic())))

    def _choose(self) -> tuple[str, Service]:
        """The next fault and its target: the next of ``--first-faults`` (on a process
        that takes it), else drawn with the odds of each kind of process."""
        enabled = set(self.args.targets.split(","))
        pools = [
            (weight, group)
            for target, weight, group in (
                ("nodes", 0.45, self._nodes()),
                ("coordinators", 0.25, self._coordinators()),
                ("etcd", 0.15, [self.services["etcd"]]),
                ("clients", 0.15, self.workers),
            )
            if target in enabled and group
        ]
        first = self._first[0] if self._first else ""
        if first:
            pools = [(w, g) for w, g in pools if first in FAULT_KINDS[g[0].kind]]
        group = self.rng.choices([g for _, g in pools], [w for w, _ in pools])[0]
        svc = self.rng.choice(group)
        if first:
            return first, svc
        odds = FAULT_KINDS[svc.kind]
        return self.rng.choices(list(odds), list(odds.values()))[0], svc

    def _fault(self) -> None:
        kind, svc = self._choose()
        pid = self.pid(svc)
        if pid is None:
            return
        if self._first and kind == self._first[0]:
            self._first.pop(0)
        f = Fault(kind, svc.name, time.monotonic())
        with self.lock:
            self.faults.append(f)
        span = [f.start, float("inf")]
        if svc.kind == "client":  # its own calls and ticks are not what we measure
            with self.lock:
                self.pauses[svc.index].append(span)
        if kind == "stop":
            self._stop(svc, pid, f)
        else:
            self._crash(svc, f)
        f.end = span[1] = time.monotonic()
        if kind != "stop":
            f.hold_s = round(f.end - f.start, 3)
        with self.lock:
            self._pending.append(f)
        threading.Thread(target=self._probe, args=(svc, f), daemon=True).start()

    def _stop(self, svc: Service, pid: int, f: Fault) -> None:
        """SIGSTOP, SIGCONT after 0.5-5 s."""
        f.hold_s = self.rng.uniform(0.5, 5.0)
        log(
            f"[{self.rel(f.start):7.1f} s] fault #{len(self.faults)}: SIGSTOP "
            f"{svc.name} for {f.hold_s:.1f} s"
        )
        svc.stopped = True
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(f.hold_s)
        finally:
            os.kill(pid, signal.SIGCONT)
            svc.stopped = False

    def _crash(self, svc: Service, f: Fault) -> None:
        """SIGKILL, then a restart after 0-1.5 s: ``kill`` on the same ports (and pool),
        ``replace`` on an emptied pool directory, ``move`` on new ports (nodes)."""
        down = self.rng.uniform(0.0, 1.5)
        then = f"restart after {down:.1f} s"
        if f.kind == "replace":
            then += " on an empty pool"
        elif f.kind == "move":
            old = svc.port
            # picked while the old ports are still bound: neither comes back
            svc.port, svc.http_port = free_port(), free_port()
            f.moved_to = svc.address
            then += f" on {svc.address} (was port {old})"
        log(f"[{self.rel(f.start):7.1f} s] fault #{len(self.faults)}: kill -9 {svc.name}, {then}")
        svc.expected_down = True
        self._kill(svc)
        if f.kind == "replace":  # what a cleaned /dev/shm or a new emptyDir leaves
            shutil.rmtree(svc.shm_dir)
            os.makedirs(svc.shm_dir)
        time.sleep(down)
        self._restart(svc, f)
        svc.expected_down = False
        if svc.kind == "node" and svc.proc is not None and svc.proc.alive():
            found = (REATTACHED.search(line) for line in svc.proc.log)
            f.reattached = next((int(m[1]) for m in found if m), 0)

    def _restart(self, svc: Service, f: Fault | None) -> None:
        deadline = time.monotonic() + RESTART_FOR_S
        while True:
            if f is not None:
                f.restart_attempts += 1
            try:
                self._start(svc)
                return
            except RuntimeError as e:
                msg = str(e).splitlines()
                if f is not None:
                    f.restart_error = " | ".join(msg[-3:])[-400:]
                if time.monotonic() > deadline:
                    log(f"  restart of {svc.name} failed for {RESTART_FOR_S:.0f} s: {msg[-1:]}")
                    return
                time.sleep(0.5)

    def _restart_crashed(self) -> None:
        """A process that died without a fault is a defect: record it, restart it."""
        for svc in list(self.services.values()):
            if svc.kind == "client" and svc.crashed:
                svc.crashed = False
                self._restart(svc, None)
                svc.expected_down = False
                continue
            if svc.expected_down or svc.kind == "client" or self.pid(svc) is not None:
                continue
            tail = self._log_tail(svc)
            rc = None
            if svc.kind == "etcd":
                p = self.etcd._proc
                rc = None if p is None else p.returncode
            elif svc.proc is not None:
                rc = svc.proc.popen.returncode
            crash = {
                "at_s": self.rel(time.monotonic()),
                "target": svc.name,
                "rc": rc,
                "log_tail": tail,
            }
            log(f"[{crash['at_s']:7.1f} s] {svc.name} DIED on its own (rc {rc}); restarting")
            for line in tail[-6:]:
                log(f"    | {line}")
            self.crashes.append(crash)
            self._restart(svc, None)

    def _probe(self, svc: Service, f: Fault) -> None:
        """Time from the fault's end to the target answering /health (etcd: its own)."""
        deadline = f.end + 60
        while time.monotonic() < deadline and not self.done.is_set():
            if svc.kind == "etcd":
                ok = self.etcd.healthy()
            elif svc.kind == "client":
                ok = self._beats is not None and self._beats[svc.index, 0] > f.end
            else:
                try:
                    url = f"http://127.0.0.1:{svc.http_port}/health"
                    with urllib.request.urlopen(url, timeout=0.5) as r:
                        ok = r.status == 200
                except OSError:
                    ok = False
            if ok:
                with self.lock:
                    f.probe_s = round(time.monotonic() - f.end, 3)
                break
            time.sleep(0.05)
        if svc.kind == "coordinator" and f.probe_s is not None:
            asyncio.run(self._probe_index(svc, f, deadline))

    async def _probe_index(self, svc: Service, f: Fault, deadline: float) -> None:
        """Lookups sent to this coordinator alone until one hits a block stored lately
        (its index is back): clients that failed over elsewhere never tell."""
        from pegaflow.transport.rpc_client import RpcClient

        rpc = RpcClient([svc.address], timeout=1.0)
        try:
            while time.monotonic() < deadline and not self.done.is_set():
                for h in list(self.tally.recent_puts[-8:]):
                    with contextlib.suppress(Exception):
                        res = await rpc.call("lookup", {"ns": NS, "hashes": [h], "shards": [0]})
                        if res.get("hits"):
                            with self.lock:
                                f.index_s = round(time.monotonic() - f.end, 3)
                            return
                await asyncio.sleep(0.05)
        finally:
            await rpc.close()

    # -- monitoring -----------------------------------------------------------------

    def _monitor_loop(self) -> None:
        next_progress = time.monotonic() + 10
        prev = time.monotonic()
        while not self.done.is_set():
            lag = time.monotonic() - prev - 0.05
            if prev and lag > self.tally.orchestrator_lag_ms / 1e3:
                self.tally.orchestrator_lag_ms = lag * 1e3
            self._sample_beats()
            self._drain()
            self._check_recoveries()
            now = time.monotonic()
            if now >= next_progress:
                next_progress = now + 10
                t = self.tally
                log(
                    f"[{self.rel(now):7.1f} s] ops {dict(t.ops)}, errors {sum(t.errors.values())}"
                    f", wrong bytes {t.wrong_bytes}, late writes {t.late_writes}, max stall "
                    f"{max(t.stall_by_kind.values(), default=0) * 1e3:.0f} ms, max freeze "
                    f"{t.max_freeze_ms:.0f} ms"
                )
            prev = time.monotonic()
            time.sleep(0.05)

    def _paused(self, worker: int, t0: float, t1: float, margin: float = 0.2) -> bool:
        with self.lock:
            spans = [tuple(s) for s in self.pauses.get(worker, ())]
        return any(t0 < e + margin and t1 > s - margin for s, e in spans)

    def _worker_stopped(self, worker: int) -> bool:
        return self.workers[worker].stopped

    def _sample_beats(self) -> None:
        beats = self._beats
        if beats is None:
            return
        now = time.monotonic()
        t = self.tally
        for w in range(beats.shape[0]):
            if self._worker_stopped(w) or self._paused(w, now - 0.3, now):
                continue
            svc = self.workers[w]
            if svc.popen is None or svc.popen.poll() is not None:
                if svc.popen is not None and not self.stopping and not svc.expected_down:
                    svc.expected_down = svc.crashed = True  # reported once, then restarted
                    crash = {
                        "at_s": self.rel(now),
                        "target": svc.name,
                        "rc": svc.popen.returncode,
                        "log_tail": self._log_tail(svc),
                    }
                    log(f"[{crash['at_s']:7.1f} s] client {svc.name} DIED (rc {crash['rc']})")
                    for line in crash["log_tail"][-6:]:
                        log(f"    | {line}")
                    self.crashes.append(crash)
                continue
            last = beats[w, 0]
            if last > 0:
                gap = (now - last - TICK_S) * 1e3
                t.max_beat_gap_ms = max(t.max_beat_gap_ms, gap)
            for k in range(self.args.tasks):
                dl = beats[w, 1 + 2 * k]
                if dl > 0 and now - dl > t.inflight_overdue.get("overdue_ms", 0) / 1e3:
                    kind = KIND_NAMES.get(float(beats[w, 2 + 2 * k]), "?")
                    t.inflight_overdue = {
                        "overdue_ms": round((now - dl) * 1e3),
                        "kind": kind,
                        "worker": f"w{w}",
                        "t0": dl - DEADLINES_S.get(kind, 0.0),
                        "t1": now,
                    }

    def _faults_at(self, t0: float, t1: float) -> list[str]:
        """The faults under way between ``t0`` and ``t1`` (or ended less than 3 s before)."""
        with self.lock:
            faults = list(self.faults)
        out = [
            f"#{i + 1} {f.kind} {f.target}"
            for i, f in enumerate(faults)
            if f.start <= t1 and (f.end or t1) + 3.0 >= t0
        ]
        return out[-4:]

    def _annotate(self, rec: dict[str, Any]) -> dict[str, Any]:
        """``rec`` with its times made relative, the faults under way, and the fault
        whose end (SIGCONT, restart) came within 150 ms of its own end, if any: a call
        or a loop released the moment a hung peer resumed was waiting on that peer."""
        out = {k: v for k, v in rec.items() if k not in ("t0", "t1")}
        t0, t1 = rec["t0"], rec["t1"]
        out["at_s"] = self.rel(t0)
        out["during"] = self._faults_at(t0, t1)
        with self.lock:
            faults = list(self.faults)
        for i, f in enumerate(faults):
            if f.end and abs(t1 - f.end) < 0.15:
                out["released_by"] = f"#{i + 1} {f.kind} {f.target}"
        return out

    def _drain(self) -> None:
        for w in range(len(self.workers)):
            path = self.tmp / f"w{w}.jsonl"
            try:
                with open(path, "rb") as fh:
                    fh.seek(self._offsets.get(w, 0))
                    data = fh.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self._offsets[w] = self._offsets.get(w, 0) + end
            for line in data[:end].splitlines():
                try:
                    self._fold(w, json.loads(line))
                except (ValueError, KeyError, TypeError):
                    continue

    def _fold(self, w: int, ev: dict[str, Any]) -> None:
        t = self.tally
        e = ev.get("e")
        if e == "op":
            self._fold_op(w, ev)
        elif e == "bad":
            n, when = int(ev["n"]), float(ev["t"])
            ev = {k: v for k, v in ev.items() if k not in ("e", "t")}
            ev.update(worker=f"w{w}", t0=when - 6.0, t1=when)
            if ev["where"] == "return":
                t.wrong_bytes += n
            else:
                t.late_writes += n
                t.wrong_bytes += int(ev.get("verified", 0))
            t.bad_events.append(ev)
            log(
                f"[{self.rel(ev['t1']):7.1f} s] !! {n} block(s) with wrong bytes ({ev['where']})"
                f" in w{w}, after {self._faults_at(ev['t0'], ev['t1'])}"
            )
        elif e == "freeze":
            if self._paused(w, ev["t"] - ev["ms"] / 1e3, ev["t"], margin=0.5):
                return
            t.max_freeze_ms = max(t.max_freeze_ms, ev["ms"])
            if ev["ms"] >= STALL_LIMIT_S * 1e3 and len(t.freezes) < 50:
                t.freezes.append(
                    {
                        "worker": f"w{w}",
                        "ms": ev["ms"],
                        "t0": ev["t"] - ev["ms"] / 1e3,
                        "t1": ev["t"],
                    }
                )

    def _fold_op(self, w: int, ev: dict[str, Any]) -> None:
        t = self.tally
        kind, t0, t1, err = ev["k"], ev["t0"], ev["t1"], ev["err"]
        t.ops[kind] += 1
        if err is not None:
            key = f"{kind}:{err.split(':')[0] if err.startswith('untyped') else err}"
            if err.startswith("untyped") and not t.errors[key]:
                log(f"  !! untyped error from the client ({kind}): {err}")
            t.errors[key] += 1
            t.error_times.append((t1, key, ev["tg"]))
        paused = self._paused(w, t0, t1)
        if paused:
            t.excluded_calls += 1
        else:
            stall = t1 - (t0 + ev["dl"])
            t.stall_by_kind[kind] = max(t.stall_by_kind.get(kind, 0.0), stall)
            t.slowest[kind] = max(t.slowest.get(kind, 0.0), t1 - t0)
            if stall >= STALL_LIMIT_S and len(t.stalls) < 200:
                t.stalls.append(
                    {
                        "kind": kind,
                        "target": ev["tg"] or ",".join(ev.get("nodes", {})),
                        "stall_ms": round(stall * 1e3),
                        "worker": f"w{w}",
                        "err": err,
                        "t0": t0,
                        "t1": t1,
                    }
                )
        if err is None:
            t.ok_times[f"w{w}"].append(t1)
        if kind == "put":
            t.blocks["put_stored"] += ev.get("n", 0)
            if err is None:
                t.ok_times[ev["tg"]].append(t1)
                t.ok_times[f"{ev['tg']}@w{w}"].append(t1)
                if ev.get("n") and ev.get("h"):
                    t.recent_puts.append(bytes.fromhex(ev["h"]))
                    del t.recent_puts[:-16]
        elif kind == "lookup":
            t.blocks["lookup_hits"] += ev.get("hits", 0)
            if err is None:
                t.ok_times[ev["tg"]].append(t1)
                if ev.get("hits"):
                    t.fresh_hits.append((ev["pt"], t1))
        elif kind == "get":
            for node, (asked, good) in ev.get("nodes", {}).items():
                t.blocks["get_ok"] += good
                t.blocks["get_miss"] += asked - good
                if good:
                    t.ok_times[node].append(t1)
                    t.ok_times[f"{node}@w{w}"].append(t1)
                if good and self._replaced(node, ev["pt"], t0):
                    t.served_after_replace += good
                    t.bad_events.append(
                        {"where": "after_replace", "node": node, "n": good, "worker": f"w{w}",
                         "t0": t0, "t1": t1}
                    )  # fmt: skip
                    log(
                        f"[{self.rel(t1):7.1f} s] !! {good} block(s) stored on {node} before "
                        f"its pool was replaced were served, to w{w}"
                    )

    def _replaced(self, node: str, stored: float, t0: float) -> bool:
        """Whether ``node``'s pool was replaced after ``stored`` and before ``t0``."""
        with self.lock:
            return any(
                f.kind == "replace" and f.target == node and stored < f.start and 0 < f.end <= t0
                for f in self.faults
            )

    def _recovery(self, f: Fault, tail: int | None = None) -> float | None:
        """First successful op against the fault's target after the fault ended (only
        among the last ``tail`` successes of that target, for the live check)."""
        t = self.tally
        if f.target == "etcd":
            pairs = t.fresh_hits if tail is None else t.fresh_hits[-tail:]
            after = [t1 for pt, t1 in pairs if pt >= f.end]
            return round(min(after) - f.end, 3) if after else None
        svc = self.services[f.target]
        return self._first_ok(svc.address if svc.kind == "coordinator" else f.target, f, tail)

    def _every_client(self, f: Fault, tail: int | None = None) -> float | None:
        """(nodes) Until every client had a successful op on the node after the fault
        ended: a client still using the node's old record (``move``) shows here."""
        firsts = [self._first_ok(f"{f.target}@{w.name}", f, tail) for w in self.workers]
        return None if None in firsts else max(x for x in firsts if x is not None)

    def _lost_nodes(self) -> list[dict[str, Any]]:
        """The node faults after which some client never had a successful op on the
        node again, though the load went on :data:`REACH_S` or more."""
        out = []
        for i, f in enumerate(self.faults):
            if self.services[f.target].kind != "node" or f.every_client_s is not None:
                continue
            if not f.end or f.end + REACH_S > self.load_end:
                continue
            keys = {w.name: f"{f.target}@{w.name}" for w in self.workers}
            clients = [w for w, key in keys.items() if self._first_ok(key, f, None) is None]
            out.append({"fault": f"#{i + 1} {f.kind} {f.target}", "clients": clients})
        return out

    def _first_ok(self, key: str, f: Fault, tail: int | None) -> float | None:
        times = self.tally.ok_times.get(key, [])
        after = [x for x in (times if tail is None else times[-tail:]) if x >= f.end]
        return round(min(after) - f.end, 3) if after else None

    def _check_recoveries(self, final: bool = False) -> None:
        """Settle and log the recovery of each ended fault once it is known (or 60 s
        passed; ``final``: now, from every op of the run)."""
        with self.lock:
            pending = list(self._pending)
        now = time.monotonic()
        tail = None if final else 5000
        for f in pending:
            r = self._recovery(f, tail)
            kind = self.services[f.target].kind
            every = self._every_client(f, tail) if kind == "node" else None
            unknown = (
                f.probe_s is None
                or (r is None and not (kind == "coordinator" and f.index_s is not None))
                or (kind == "node" and every is None)
            )
            if unknown and not final and now - f.end < 60:
                continue
            f.recover_s, f.every_client_s = r, every
            with self.lock:
                self._pending.remove(f)
            i = self.faults.index(f) + 1
            probe = "-" if f.probe_s is None else f"{f.probe_s:.2f} s"
            what = "none" if r is None else f"{r:.2f} s"
            if kind == "coordinator" and r is None:
                what += " (its clients failed over elsewhere)"
            if kind == "node":
                what += f" (every client {'none' if every is None else f'{every:.2f} s'})"
            index = f", its lookups hit again {f.index_s:.2f} s" if f.index_s is not None else ""
            pool = f", {f.reattached} blocks re-attached" if f.reattached is not None else ""
            log(
                f"[{self.rel(now):7.1f} s]   fault #{i} ({f.kind} {f.target}): first good op "
                f"{what} after it ended, /health {probe}{index}{pool}"
            )

    # -- the end ----------------------------------------------------------------------

    def stop_workers(self) -> None:
        self.stopping = True
        for w in self.workers:
            if w.popen is not None and w.popen.poll() is None:
                w.popen.send_signal(signal.SIGTERM)
        grace = time.monotonic() + TRANSFER_DEADLINE_S + STALL_LIMIT_S + 8.0
        for w in self.workers:
            assert w.popen is not None
            try:
                w.popen.wait(max(0.1, grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.hung_workers.append(w.name)
                log(f"  !! client {w.name} did not stop within its deadlines: killed")
                w.popen.kill()
                w.popen.wait(10)
            if w.popen.returncode != 0 and not w.expected_down and w.name not in self.hung_workers:
                self.crashes.append(
                    {"target": w.name, "rc": w.popen.returncode, "log_tail": self._log_tail(w)}
                )

    def scan_logs(self) -> None:
        """Count the lines of each process's log that speak of a failure (a restarted
        process's log starts anew)."""
        for svc in self.services.values():
            if svc.kind == "etcd":
                continue
            lines = (
                self._log_tail(svc, 10**6) if svc.kind == "client" else self._log_tail(svc, 5000)
            )
            hits = _common.log_findings(lines)
            if hits:
                self.log_findings[svc.name] = hits

    def finish(self) -> None:
        """Stop monitoring (after a last read of the events)."""
        self.done.set()
        if self._monitor is not None:
            self._monitor.join(5)
        self._drain()
        self._check_recoveries(final=True)

    def cleanup(self) -> None:
        """Every process killed (stopped ones too), every temporary directory removed."""
        for svc in self.services.values():
            pid = self.pid(svc)
            if pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)
        for w in self.workers:
            if w.popen is not None and w.popen.poll() is None:
                w.popen.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.popen.wait(10)
        for svc in self.services.values():
            if svc.kind in ("coordinator", "node") and svc.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    svc.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.etcd.kill()
        if self.args.keep:
            for svc in self.services.values():
                if svc.proc is not None:
                    (self.tmp / f"{svc.name}.log").write_text("\n".join(svc.proc.log) + "\n")
            log(f"kept {self.tmp} (events, logs; the pools in {self.shm} are removed)")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)

    def report(self) -> dict[str, Any]:
        t = self.tally
        stall_s = max(t.stall_by_kind.values(), default=0.0)
        stall_s = max(stall_s, t.inflight_overdue.get("overdue_ms", 0) / 1e3)
        quiet = Counter(f"{k}@{tg}" for when, k, tg in t.error_times if when >= self.quiet_from)
        failed = []
        if t.wrong_bytes:
            failed.append(f"wrong_bytes {t.wrong_bytes}")
        if t.late_writes:
            failed.append(f"late_writes {t.late_writes}")
        if t.served_after_replace:
            failed.append(f"served_after_replace {t.served_after_replace}")
        lost = self._lost_nodes()
        if lost:
            failed.append(f"nodes_lost_by_clients {len(lost)}")
        if stall_s >= STALL_LIMIT_S:
            failed.append(f"max_stall_ms {stall_s * 1e3:.0f} >= {STALL_LIMIT_S * 1e3:.0f}")
        if self.error:
            failed.append(self.error)
        end = self.load_end if self.load_end and not self.interrupted else time.monotonic()
        return {
            "ok": not failed and not self.interrupted,
            "failed": failed,
            "interrupted": self.interrupted,
            "duration_s": round(end - self.load_start, 1) if self.load_start else 0.0,
            "seed": self.seed,
            "tls": self.env.get("UCX_TLS", "default"),
            "clients": {"workers": len(self.workers), "tasks": self.args.tasks},
            "cluster": {
                "coordinators": len(self._coordinators()),
                "nodes": len(self._nodes()),
                "pool": self.args.pool,
                "slab": self.args.slab,
                "block_bytes": self.args.block_kib << 10,
                "batch": self.args.batch,
            },
            "deadlines_s": DEADLINES_S,
            "ops": dict(t.ops),
            "blocks": dict(t.blocks),
            "errors": dict(t.errors),
            "errors_after_faults": dict(quiet),
            "wrong_bytes": t.wrong_bytes,
            "late_writes": t.late_writes,
            "served_after_replace": t.served_after_replace,
            "bad_events": [self._annotate(e) for e in t.bad_events[:20]],
            "max_stall_ms": round(stall_s * 1e3),
            "stall_by_kind_ms": {k: round(v * 1e3) for k, v in t.stall_by_kind.items()},
            "slowest_call_ms": {k: round(v * 1e3) for k, v in t.slowest.items()},
            "stalls_over_limit": len(t.stalls),
            "worst_stalls": [
                self._annotate(s) for s in sorted(t.stalls, key=lambda s: -s["stall_ms"])[:8]
            ],
            "worst_inflight": self._annotate(t.inflight_overdue) if t.inflight_overdue else None,
            "max_loop_freeze_ms": round(t.max_freeze_ms),
            "max_heartbeat_gap_ms": round(t.max_beat_gap_ms),
            "freezes_over_limit": [self._annotate(f) for f in t.freezes[:12]],
            "calls_of_paused_clients": t.excluded_calls,
            "machine": {
                "orchestrator_lag_ms": round(t.orchestrator_lag_ms),
                "loadavg_start": self.loadavg_start,
                "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            },
            "faults": [
                {
                    "kind": f.kind,
                    "target": f.target,
                    "at_s": self.rel(f.start),
                    "for_s": round(f.hold_s, 2),
                    "recover_s": f.recover_s,
                    "health_s": f.probe_s,
                    **(
                        {"every_client_s": f.every_client_s}
                        if self.services[f.target].kind == "node"
                        else {}
                    ),
                    **(
                        {"index_s": f.index_s}
                        if self.services[f.target].kind == "coordinator"
                        else {}
                    ),
                    "errors": dict(
                        Counter(k for when, k, _ in t.error_times if f.start <= when <= f.end + 3)
                    ),
                    **({"moved_to": f.moved_to} if f.moved_to else {}),
                    **({"reattached": f.reattached} if f.reattached is not None else {}),
                    **({"restarts": f.restart_attempts} if f.restart_attempts > 1 else {}),
                    **({"restart_error": f.restart_error} if f.restart_error else {}),
                }
                for f in self.faults
            ],
            "recovery_by_kind": self.recovery_by_kind(),
            "crashes": self.crashes,
            # SIGKILL from outside: the OOM killer of a shared machine, say (figures suspect)
            "killed_from_outside": [c["target"] for c in self.crashes if c["rc"] == -9],
            "hung_clients": self.hung_workers,
            "nodes_lost_by_clients": lost,
            "log_findings": self.log_findings,
            "pids": self.pids,
            "dirs": [str(self.tmp), str(self.shm)],
        }

    def recovery_by_kind(self) -> dict[str, dict[str, Any]]:
        """Per kind of fault and of process (``"move node"``): how many faults, how many
        were followed by a good op, and the range ``[min, max]`` (s) of each recovery
        time measured: first good op, (nodes) a good op of every client, ``/health``,
        (coordinators) its own lookups."""
        groups: dict[str, list[Fault]] = defaultdict(list)
        for f in self.faults:
            groups[f"{f.kind} {self.services[f.target].kind}"].append(f)
        out: dict[str, dict[str, Any]] = {}
        for key, faults in sorted(groups.items()):
            row: dict[str, Any] = {
                "faults": len(faults),
                "recovered": sum(f.recover_s is not None for f in faults),
            }
            for name, attr in (
                ("recover_s", "recover_s"),
                ("every_client_s", "every_client_s"),
                ("health_s", "probe_s"),
                ("index_s", "index_s"),
            ):
                times = [x for f in faults if (x := getattr(f, attr)) is not None]
                if times:
                    row[name] = [min(times), max(times)]
            out[key] = row
        return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=2.0, help="length of the run")
    ap.add_argument("--seed", type=int, default=None, help="fault and load schedule (random)")
    ap.add_argument(
        "--tls",
        choices=("default", "tcp"),
        default="default",
        help="UCX transports of nodes, coordinators and clients: UCX's own choice, or "
        "UCX_TLS=tcp (a hung peer over TCP is what froze event loops)",
    )
    ap.add_argument("--workers", type=int, default=3, help="client processes")
    ap.add_argument("--tasks", type=int, default=2, help="concurrent op loops per client")
    ap.add_argument("--coordinators", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--pool", default="64MiB", help="pool of each node")
    ap.add_argument("--slab", default="4MiB", help="slab of each node")
    ap.add_argument("--block-kib", type=int, default=BLOCK_KIB, help="block size (KiB)")
    ap.add_argument("--batch", type=int, default=BATCH, help="blocks per put or get")
    ap.add_argument("--think-ms", type=float, default=20.0, help="pause between two ops")
    _common.add_cooldown(ap, most_s=10)
    ap.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"comma-separated processes to fault, of {','.join(TARGETS)}",
    )
    ap.add_argument(
        "--first-faults",
        default="",
        metavar="KINDS",
        help="comma-separated kinds of fault applied first, in this order, each to a process "
        "that takes it (e.g. replace,move: on nodes); then they are drawn at random",
    )
    ap.add_argument(
        "--keep", action="store_true", help="keep the events and logs (temporary directory)"
    )
    args = ap.parse_args()
    targets = args.targets.split(",")
    if not set(targets) <= set(TARGETS):
        ap.error(f"--targets: choose among {','.join(TARGETS)}")
    kinds = {k for t in targets for k in FAULT_KINDS[TARGETS[t]]}
    if not {k for k in args.first_faults.split(",") if k} <= kinds:
        ap.error(f"--first-faults: the targets take {','.join(sorted(kinds))}")
    _common.trap_signals()
    chaos = Chaos(args)
    rc = 0
    try:
        chaos.error = _common.start_error("cluster", chaos.start_cluster, chaos.start_workers)
        if chaos.error:
            rc = 2
        else:
            chaos.run()
            chaos.stop_workers()
    except KeyboardInterrupt:
        chaos.interrupted = True
        log("interrupted: cleaning up")
    finally:
        _common.mute_signals()
        chaos.finish()
        chaos.scan_logs()
        chaos.cleanup()
    report = chaos.report()
    for key, row in report["recovery_by_kind"].items():
        log(f"recovery, {key}: {row}")
    print(json.dumps(report), flush=True)
    if chaos.interrupted:
        return 130
    return rc or (0 if report["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
