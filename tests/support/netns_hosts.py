"""Test helper: several hosts on one machine, made of Linux namespaces.

A *host* is a network namespace on a bridge (addresses in 198.18.0.0/24, benchmarking
space that exists only inside these namespaces) and an IPC namespace, shared by the
host's processes, which also run in a mount and UTS namespace of their own, with a
private ``/dev/shm`` (a directory bind-mounted there), a boot id of their own (a file
bind-mounted over ``/proc/sys/kernel/random/boot_id``: UCX, and our address check, tell
hosts apart by it) and a host name of their own.  A namespace alone is not a host:
without the boot id and ``/dev/shm``, UCX takes two namespaces for one machine.

A *pod* is what Kubernetes makes of a container beside a ``hostNetwork`` storage node:
its own network namespace (its own address on the bridge) and IPC namespace, on the
kernel of its host (the host's boot id), with the host's ``/dev/shm`` mounted in (a
``hostPath`` volume) and a host name of its own.  (A host's IPC namespace is not the
machine's either, as a DaemonSet's container without ``hostIPC`` has its own: UCX
then flags both sides' shared-memory addresses with a namespace.)

The bridge lives in a namespace of its own (the *switch*); nothing is added to the
machine's own network namespace, and every namespace and directory is removed by
:meth:`NetHosts.close`.  Partitions: :meth:`NetHosts.cut` takes a host's port on the
bridge down (no ``tc`` or iptables here), :meth:`NetHosts.restore` brings it back.

Needs root (``ip netns add``); :func:`available` says whether this machine allows it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SUBNET = "198.18.0"
"""the /24 the hosts' addresses are taken from (RFC 2544 benchmarking space)"""
TAG = "pft"
"""prefix of every namespace and directory made here, followed by the owning process's
id: the leftovers of a run that was killed before its cleanup (its process is gone) are
removed by the next one, and those of a run still going are left alone"""
OWNER_VAR = "PFT_OWNER"
"""environment variable naming the owning process's id, set on every process started on
a host (and on the processes that keep the hosts' IPC namespaces), so that the
processes a killed run left behind can be found and killed"""

_ENTER = ("nsenter", "--net={netns}", "--ipc=/proc/{holder}/ns/ipc")
_HOST_SETUP = (  # the boot id first: its file is under the /dev/shm being replaced
    'mount --bind "$PF_BOOT_ID" /proc/sys/kernel/random/boot_id && mount --bind "$PF_SHM" '
    '/dev/shm && hostname "$PF_HOSTNAME" && exec "$@"'
)


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


def available() -> str | None:
    """None when namespaces can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"{TAG}-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot create a network namespace: {e}"
    _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead_owner(name: str) -> bool:
    """Whether ``name`` (``<TAG>-<pid>-...``) was made by a process that is gone."""
    parts = name.split("-")
    if len(parts) < 3 or parts[0] != TAG or not parts[1].isdigit():
        return False
    return not _alive(int(parts[1]))


def remove_leftovers() -> None:
    """Remove what earlier runs left when they were killed before their cleanup: their
    processes (found by :data:`OWNER_VAR`), namespaces and directories.  Runs whose
    owner still lives (another test at the same time) are left alone."""
    for d in Path("/proc").glob("[0-9]*"):
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for var in env:
            if var.startswith(f"{OWNER_VAR}=".encode()):
                owner = var.split(b"=", 1)[1]
                if owner.isdigit() and not _alive(int(owner)):
                    try:
                        os.kill(int(d.name), signal.SIGKILL)
                    except OSError:
                        pass
                break
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if _dead_owner(name):
            _ip("netns", "del", name, check=False)
    for d in Path("/dev/shm").glob(f"{TAG}-*"):
        if _dead_owner(d.name):
            shutil.rmtree(d, ignore_errors=True)


@dataclass
class Host:
    """A host (or pod) of :class:`NetHosts`: run a process on it with :attr:`prefix`."""

    name: str
    ip: str
    netns: str
    shm: Path
    """its ``/dev/shm`` (a pod's is its host's)"""
    boot_id: Path
    port: str
    """its veth's end on the bridge (in the switch namespace)"""
    ipc_holder: subprocess.Popen[bytes]
    """a process that keeps the host's IPC namespace (its processes join it)"""
    pod: bool = False
    owner: int = 0
    """id of the process that made it (:data:`OWNER_VAR`)"""

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a command on this host."""
        enter = [a.format(netns=f"/run/netns/{self.netns}", holder=self.ipc_holder.pid)
                 for a in _ENTER]  # fmt: skip
        return [
            "env", f"{OWNER_VAR}={self.owner}", f"PF_SHM={self.shm}",
            f"PF_BOOT_ID={self.boot_id}", f"PF_HOSTNAME={self.name}", *enter,
            "unshare", "--mount", "--uts", "--propagation", "private",
            "sh", "-c", _HOST_SETUP, self.name,
        ]  # fmt: skip

    def run(
        self, argv: Sequence[str], timeout: float = 60.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on this host to completion."""
        return subprocess.run(
            [*self.prefix, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )


def _ipc_holder() -> subprocess.Popen[bytes]:
    """A process alone in a new IPC namespace, for as long as it lives."""
    return subprocess.Popen(
        ["unshare", "--ipc", "sleep", "infinity"],
        stdin=subprocess.DEVNULL,
        env={**os.environ, OWNER_VAR: str(os.getpid())},
    )


class NetHosts:
    """Hosts and pods on one bridge (see the module docstring)."""

    def __init__(self) -> None:
        remove_leftovers()
        self.owner = os.getpid()
        self.run_id = f"{self.owner}-{uuid.uuid4().hex[:6]}"
        self.dir = Path(tempfile.mkdtemp(prefix=f"{TAG}-{self.run_id}-", dir="/dev/shm"))
        self.switch = f"{TAG}-{self.run_id}-sw"
        self.hosts: dict[str, Host] = {}
        self._next_ip = 1
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)

    def _attach(self, name: str) -> tuple[str, str, str]:
        """A namespace for ``name`` with a veth on the bridge: (netns, ip, bridge port)."""
        netns = f"{TAG}-{self.run_id}-{name}"
        ip = f"{SUBNET}.{self._next_ip}"
        port = f"p{self._next_ip}"
        self._next_ip += 1
        _ip("netns", "add", netns)
        _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", ns=self.switch)
        _ip("link", "set", "eth0", "netns", netns, ns=self.switch)
        _ip("link", "set", port, "master", "br0", "up", ns=self.switch)
        _ip("addr", "add", f"{ip}/24", "dev", "eth0", ns=netns)
        _ip("link", "set", "eth0", "up", ns=netns)
        _ip("link", "set", "lo", "up", ns=netns)
        return netns, ip, port

    def add_host(self, name: str) -> Host:
        """A new host with its own address, ``/dev/shm``, boot id and host name."""
        netns, ip, port = self._attach(name)
        shm = self.dir / f"shm-{name}"
        shm.mkdir()
        boot_id = self.dir / f"boot-id-{name}"
        boot_id.write_text(f"{uuid.uuid4()}\n")
        host = self.hosts[name] = Host(
            name, ip, netns, shm, boot_id, port, _ipc_holder(), owner=self.owner
        )
        return host

    def add_pod(self, name: str, on: Host) -> Host:
        """A pod on host ``on``: its own address (network namespace) and IPC namespace,
        ``on``'s kernel (boot id) and ``/dev/shm`` (a hostPath mount)."""
        netns, ip, port = self._attach(name)
        holder = _ipc_holder()
        pod = Host(name, ip, netns, on.shm, on.boot_id, port, holder, pod=True, owner=self.owner)
        self.hosts[name] = pod
        return pod

    def cut(self, host: Host) -> None:
        """Partition ``host``: its port on the bridge goes down."""
        _ip("link", "set", host.port, "down", ns=self.switch)

    def restore(self, host: Host) -> None:
        """End the partition of ``host``."""
        _ip("link", "set", host.port, "up", ns=self.switch)

    def close(self) -> None:
        """Remove every namespace and directory made here (processes on the hosts must
        have been stopped first)."""
        for h in self.hosts.values():
            _ip("netns", "del", h.netns, check=False)
            h.ipc_holder.kill()
            h.ipc_holder.wait(10)
        _ip("netns", "del", self.switch, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
