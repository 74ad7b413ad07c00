"""Which address each process binds and advertises: one rule for every entry point.

A storage node's ``[node] host`` is both where its data plane listens and the address
it publishes in etcd for every client of the cluster; a coordinator's ``[coordinator]
host`` is where clients on other hosts reach it; a client's ``[client] host`` tells
placement which host it is on.  Their default is ``auto``:

* when etcd (for a node or coordinator) or the coordinators (for a client) are on
  another host, the address of this host that the kernel routes to the first of them
  from (a UDP socket's local address after ``connect``: a routing lookup, nothing is
  sent), so that a cluster of several hosts needs no address given by hand;
* otherwise (no etcd, or etcd on loopback: one host) ``127.0.0.1``, as before.

An HTTP endpoint's host (``http_host``) left empty follows its component's host, so a
node's ``/health`` and ``/metrics`` are where ``pegaflow status`` and Prometheus look
for them (the address in its record).

A node that would publish a loopback or wildcard address (``127.0.0.1``, ``0.0.0.0``)
to an etcd on another host is refused at start: every other host would reach its own
loopback (or nothing), and a node on the same address there would answer in its place
(a put addressed to the node was stored by the client's own node, with no error).

Pure module: sockets are made only to ask the kernel for a route.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pegaflow.config import ClusterConfig, CoordinatorConfig, NodeConfig

AUTO = "auto"
"""the host setting that is decided at start (see the module docstring)"""
LOOPBACK = "127.0.0.1"
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def split_host(address: str) -> str:
    """The host of ``host:port`` (``[v6]:port``, an ``http(s)://`` scheme allowed)."""
    rest = re.sub(r"^https?://", "", address.strip(), flags=re.IGNORECASE).rstrip("/")
    host = rest.rpartition(":")[0] if ":" in rest else rest
    return host.strip("[]")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) names this host only."""
    ip = _ip(host)
    if ip is None:
        return host.strip().lower().rstrip(".") in _LOOPBACK_NAMES
    return ip.is_loopback


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means every interface (``0.0.0.0``, ``::``, empty)."""
    ip = _ip(host)
    return not host.strip() or (ip is not None and ip.is_unspecified)


def remote(addresses: Sequence[str]) -> list[str]:
    """Those of ``addresses`` (``host:port``) on other hosts than this one, as far as
    their form tells (a name that is not ``localhost`` counts as another host)."""
    return [a for a in addresses if not a.startswith("unix:") and not is_loopback(split_host(a))]


def route_source(address: str) -> str:
    """This host's address on the route to ``address`` (``host:port``); raises
    ``ValueError`` when its name does not resolve or no route leads there."""
    host = split_host(address)
    port = address.rstrip("/").rpartition(":")[2]
    try:
        infos = socket.getaddrinfo(host, int(port) if port.isdigit() else 0, 0, socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"cannot resolve {host!r} ({e})") from None
    last: OSError | None = None
    for family, _type, _proto, _name, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)  # a routing lookup: nothing is sent
            except OSError as e:
                last = e
                continue
            return str(s.getsockname()[0])
    raise ValueError(f"no route to {host!r} ({last})")


def auto_host(peers: Sequence[str], what: str) -> str:
    """The ``auto`` host of a process whose cluster peers (``what``, e.g. "etcd") are
    ``peers``: this host's address on the route to the first remote one, else
    ``127.0.0.1``; ``ValueError`` (naming the setting to give) when it cannot tell."""
    far = remote(peers)
    if not far:
        return LOOPBACK
    try:
        return route_source(far[0])
    except ValueError as e:
        raise ValueError(
            f"cannot tell which address of this host reaches {what} at {far[0]}: {e}"
        ) from None


def advertised_problem(host: str, etcd: Sequence[str]) -> str | None:
    """Why a node may not publish ``host`` to an etcd at ``etcd`` (None: it may)."""
    far = remote(etcd)
    if not far:
        return None
    if is_wildcard(host):
        kind = "a wildcard address, which no other host can reach"
    elif is_loopback(host):
        kind = "a loopback address: every other host would reach its own"
    else:
        return None
    return (
        f"[node] host {host or '(empty)'} is {kind}, but etcd ({far[0]}) is on another host, "
        "so clients on other hosts would use it; leave --node-host unset (auto: the "
        "address this host reaches etcd from) or give this host's address"
    )


def settle_coordinator(cfg: CoordinatorConfig, etcd: Sequence[str] = ()) -> CoordinatorConfig:
    """``cfg`` with an ``auto`` host and an empty ``http_host`` decided for a coordinator
    whose etcd is at ``etcd`` (none: an in-process one, on loopback); idempotent."""
    if cfg.host == AUTO:
        cfg = replace(cfg, host=auto_host(etcd, "etcd"))
    if not cfg.http_host:
        cfg = replace(cfg, http_host=cfg.host)
    return cfg


def settle_node(cfg: NodeConfig, etcd: Sequence[str] = ()) -> NodeConfig:
    """``cfg`` with an ``auto`` host and an empty ``http_host`` decided for a node whose
    etcd is at ``etcd`` (none: an in-process one, on loopback); ``ValueError`` for an
    address other hosts could not use (:func:`advertised_problem`); idempotent."""
    if cfg.host == AUTO:
        cfg = replace(cfg, host=auto_host(etcd, "etcd"))
    problem = advertised_problem(cfg.host, etcd)
    if problem is not None:
        raise ValueError(problem)
    if not cfg.http_host:
        cfg = replace(cfg, http_host=cfg.host)
    return cfg


def settle(cfg: ClusterConfig, sections: Sequence[str]) -> ClusterConfig:
    """``cfg`` with the hosts of the ``sections`` a program uses (``coordinator``,
    ``node``) decided against its etcd (see the module docstring)."""
    etcd = cfg.etcd.endpoints
    coord, node = cfg.coordinator, cfg.node
    if "coordinator" in sections:
        coord = settle_coordinator(coord, etcd)
    if "node" in sections:
        node = settle_node(node, etcd)
    return replace(cfg, coordinator=coord, node=node)


def client_host(coordinators: Sequence[str]) -> str:
    """A client's ``auto`` host (``[client] host``): its address on the route to its
    first remote coordinator, else ``127.0.0.1`` (only placement uses it: never fails)."""
    try:
        return auto_host(coordinators, "the coordinators")
    except ValueError:
        return LOOPBACK
