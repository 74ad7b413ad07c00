"""Which network devices the node's UCX worker may use (``[node] ucx_net_devices``).

ucxx's Python API cannot bind its connection listener to an address: ``UCXListener``
takes a port only, and the C++ ``ucxx::ListenerBuilder::host()`` is not exposed
(ucxx 0.52), so the listener on ``[node] ucx_port`` always listens on every interface
(``0.0.0.0``).  What UCX does honour is ``UCX_NET_DEVICES``: the TCP transport then
listens only on those devices' addresses, and a connection request that arrives through
another interface is *rejected* (the client sees ``UCXXRejectedError``), so a node
whose devices are the loopback only serves local clients even though its connection
listener accepts the TCP handshake from anywhere.

``auto`` (the default) picks the interface that owns ``[node] host`` (the loopback for
a loopback host) plus every RDMA device (``/sys/class/infiniband``), so RDMA keeps
working on a cluster node; ``all`` keeps UCX's default (every device); anything else is
passed to UCX as it is.  ``auto`` yields to a ``UCX_NET_DEVICES`` set in the
environment.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from pathlib import Path

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915
_IFF_LOOPBACK = 0x8


def ipv4_addresses() -> dict[str, str]:
    """``{interface: its (primary) IPv4 address}`` of this host (Linux)."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:
                continue  # no IPv4 address
            out[name] = socket.inet_ntoa(res[20:24])
    return out


def _loopback_interfaces() -> list[str]:
    names = []
    for d in sorted(Path("/sys/class/net").glob("*")):
        try:
            if int((d / "flags").read_text().strip(), 16) & _IFF_LOOPBACK:
                names.append(d.name)
        except (OSError, ValueError):
            continue
    return names


def interface_of(host: str) -> str | None:
    """The network interface that owns ``host`` (an IPv4 address or a name), or None."""
    try:
        ip = ipaddress.ip_address(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except (OSError, IndexError, ValueError):
        return None
    if ip.is_loopback:
        loopback = _loopback_interfaces()
        return loopback[0] if loopback else None
    for name, addr in ipv4_addresses().items():
        if addr == str(ip):
            return name
    return None


def rdma_devices() -> list[str]:
    """Every RDMA device port as UCX names it (``mlx5_0:1``)."""
    out = []
    for dev in sorted(Path("/sys/class/infiniband").glob("*")):
        out += [f"{dev.name}:{port.name}" for port in sorted((dev / "ports").glob("*"))]
    return out


def ucx_net_devices(setting: str, host: str) -> str | None:
    """The ``NET_DEVICES`` value for the node's UCX worker, or None for UCX's default
    (see the module docstring)."""
    setting = setting.strip()
    if setting in ("", "all"):
        return None
    if setting != "auto":
        return setting
    if os.environ.get("UCX_NET_DEVICES"):
        return None
    iface = interface_of(host)
    if iface is None:
        log.warning(
            "[node] host %s is no address of this host's interfaces: UCX uses every network "
            "device (set [node] ucx_net_devices to restrict it)",
            host,
        )
        return None
    return ",".join([iface, *rdma_devices()])
