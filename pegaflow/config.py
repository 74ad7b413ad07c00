"""Configuration of every component: one dataclass each, loaded from TOML, then
``PEGAFLOW_*`` environment variables, then command-line flags (last wins).

Each field's ``metadata["help"]`` documents it; :func:`add_arguments` turns the fields
into argparse flags and ``docs/configuration.md`` is generated from the same schema
(``python -m pegaflow.config``), so flags, env vars and docs cannot drift apart.

A TOML file has one table per component: ``[etcd]``, ``[coordinator]``, ``[node]``,
``[client]``, ``[security]``, ``[telemetry]``, ``[router]``.  Environment variables are
``PEGAFLOW_<TABLE>_<FIELD>``, e.g. ``PEGAFLOW_NODE_POOL_BYTES=8GiB``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, NoReturn, TypeVar, get_type_hints

T = TypeVar("T")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{u.lower() + "ib": 1 << (10 * (i + 1)) for i, u in enumerate("KMGT")},
    **{u.lower() + "b": 10 ** (3 * (i + 1)) for i, u in enumerate("KMGT")},
    # a bare letter is binary, as in systemd, `free -g` and `dd bs=1M`
    **{u.lower(): 1 << (10 * (i + 1)) for i, u in enumerate("KMGT")},
}
SIZE_RULE = (
    "a size is bytes (`4096`) or a number with a unit: `KiB`/`MiB`/`GiB`/`TiB` are powers "
    "of 1024 (`2GiB` = 2³¹ bytes), `KB`/`MB`/`GB`/`TB` powers of 1000 (`2GB` = 2·10⁹ "
    "bytes), and a bare `K`/`M`/`G`/`T` is binary like `GiB` (`2G` = `2GiB`, as in systemd)"
)
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")
_PORT_RANGE = (-1, 65535)


def parse_size(v: str | int | float) -> int:
    """A size into bytes: ``4096``, ``"512MiB"``, ``"8GiB"``, ``"2GB"`` (2·10⁹) or
    ``"8G"`` (binary); see :data:`SIZE_RULE`.  Anything else raises ``ValueError``."""
    if isinstance(v, bool):
        raise ValueError(f"not a size: {v!r}")
    if isinstance(v, int | float):
        if v < 0 or v != int(v):
            raise ValueError(f"not a size: {v!r} (a whole number of bytes >= 0)")
        return int(v)
    m = _SIZE_RE.match(v) if isinstance(v, str) else None
    unit = _SIZE_UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise ValueError(f"not a size: {v!r} (use e.g. 4096, 512MiB, 8GiB or 2GB)")
    n = Fraction(m.group(1)) * unit
    if n.denominator != 1:
        raise ValueError(f"not a size: {v!r} (not a whole number of bytes)")
    return int(n)


def parse_bool(v: str | bool | int) -> bool:
    """``true/false``, ``yes/no``, ``on/off``, ``1/0`` (any case) or a bool; anything else
    (``maybe``, an empty string) raises ``ValueError``."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        low = v.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    raise ValueError(f"not a boolean: {v!r} (use true/false, yes/no, on/off or 1/0)")


def check_address(addr: str) -> str:
    """``addr`` if it is ``host:port`` (``[v6]:port``, an ``http(s)://`` scheme allowed,
    as etcd endpoints have) or ``unix:/path``; else ``ValueError``."""
    if not isinstance(addr, str):
        raise ValueError(f"not an address: {addr!r} (use host:port)")
    a = addr.strip()
    if a.startswith("unix:") and len(a) > len("unix:"):
        return a
    rest = re.sub(r"^https?://", "", a, flags=re.IGNORECASE).rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not an address: {addr!r} (use host:port, e.g. 10.0.0.1:7700)")
    return a


def parse_addresses(v: str | list[str] | tuple[str, ...]) -> list[str]:
    """A comma-separated string or a list of addresses, each checked by
    :func:`check_address`."""
    if isinstance(v, str):
        items = [s.strip() for s in v.split(",") if s.strip()]
    elif isinstance(v, list | tuple):
        items = [s.strip() if isinstance(s, str) else s for s in v]
    else:
        raise ValueError(f"not a list of addresses: {v!r}")
    return [check_address(s) for s in items]


def opt(
    default: Any, help: str, *, size: bool = False, addresses: bool = False, metavar: str = ""
) -> Any:
    """A documented config field (``size=True``: accepts ``"8GiB"`` style values;
    ``addresses=True``: a list of ``host:port``; ``metavar``: its name in ``--help``)."""
    meta = {"help": help, "size": size, "addresses": addresses, "metavar": metavar}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class EtcdConfig:
    """Connection to the etcd v3 cluster that holds membership and the index."""

    endpoints: list[str] = opt(
        [],
        "etcd client endpoints, host:port; empty = no etcd (single-host mode only)",
        addresses=True,
    )
    prefix: str = opt("/pegaflow/default", "key prefix of this cluster in etcd")
    username: str = opt("", "etcd user name (empty: no authentication)")
    password: str = opt("", "etcd password")
    ca_cert: str = opt("", "CA certificate file for TLS to etcd")
    cert_cert: str = opt("", "client certificate file for TLS to etcd")
    cert_key: str = opt("", "client key file for TLS to etcd")
    lease_ttl_s: int = opt(10, "TTL of a node's lease; its entries vanish this long after it dies")
    timeout_s: float = opt(5.0, "deadline of one etcd call")
    batch_size: int = opt(128, "puts per etcd transaction (etcd's --max-txn-ops caps it)")
    flush_interval_ms: int = opt(5, "how long index writes wait to fill a batch")


@dataclass
class SecurityConfig:
    """Shared-secret authentication of the control and data planes."""

    token: str = opt("", "shared secret required on every connection (empty: none)")
    tenant_tokens: list[str] = opt(
        [],
        "tenant secrets, 'tenant=secret': such a connection may only use namespaces 'tenant@...'",
    )


@dataclass
class CoordinatorConfig:
    """The coordinator: global index mirror, lookups, placement, status."""

    host: str = opt(
        "auto",
        "interface the control protocol binds to; 'auto': this host's address on the route "
        "to etcd when etcd is on another host, else 127.0.0.1 (0.0.0.0: every interface)",
    )
    port: int = opt(7700, "control protocol port (0: any free port)")
    http_host: str = opt(
        "", "interface of the HTTP endpoint (/health, /metrics); empty: [coordinator] host"
    )
    http_port: int = opt(7780, "HTTP port (0: any free port, -1: off)")
    max_frame_bytes: int = opt(16 << 20, "largest control frame accepted", size=True)
    election_ttl_s: int = opt(
        10,
        "TTL of the lease behind the leadership of singleton duties (the index GC); "
        "a dead leader is replaced within this",
    )
    gc_interval_s: float = opt(
        300.0,
        "seconds between two index GC passes of the elected coordinator, which delete "
        "entries whose block is gone from its node (0: no GC)",
    )
    gc_batch: int = opt(1024, "index entries checked per node request by the GC")
    gc_entries_per_s: int = opt(
        100_000, "pace of a GC pass: entries checked per second at most (lookups come first)"
    )
    suspect_ttl_s: float = opt(
        5.0,
        "a node a client reports unreachable (report_unreachable) and this coordinator "
        "cannot reach either (its /health) is left out of lookups this long, renewed by "
        "further reports, or until it answers the coordinator's check again (0: reports "
        "are counted only)",
    )
    fair_slice_ms: float = opt(
        2.0,
        "a turn on the event loop: once a connection has more work than this, tenants take "
        "turns of this long, round-robin, and each tenant's connections share its turns "
        "(those with the cluster token count as one tenant); a small lookup waits about one "
        "turn of each other tenant with work waiting, a 65,536-block lookup takes several",
    )


@dataclass
class NodeConfig:
    """A storage node: a shared-memory block pool served over UCX."""

    node_id: str = opt("", "unique node name (empty: <hostname>-<ucx port>)")
    host: str = opt(
        "auto",
        "interface this node's data plane binds to (its UCX handshake socket; UCX's own "
        "transports follow ucx_net_devices) and the address it publishes for clients; "
        "'auto': this host's address on the route to etcd when etcd is on another host, "
        "else 127.0.0.1 (a loopback or wildcard address is refused with etcd on another host)",
    )
    ucx_port: int = opt(7800, "UCX listener port (0: any free port)")
    ucx_net_devices: str = opt(
        "auto",
        "network devices UCX may use and accept connections on (UCX_NET_DEVICES); 'auto': "
        "the interface that owns [node] host plus every RDMA device, so a loopback node "
        "refuses connections from other hosts; 'all': every device; else a UCX device list",
    )
    http_host: str = opt("", "interface of the HTTP endpoint; empty: [node] host")
    http_port: int = opt(7880, "HTTP port (0: any free port, -1: off)")
    pool_bytes: int = opt(
        1 << 30,
        "size of the block pool in host memory (pegaflow-server: 0, its default, or "
        "'--pool-size auto' sizes it: min(25% of RAM, 50% of shm_dir's size, 64 GiB))",
        size=True,
    )
    slab_bytes: int = opt(
        64 << 20, "allocation unit of the pool; one block size per slab", size=True
    )
    shm_dir: str = opt("/dev/shm", "directory of the pool's shared-memory file")
    keep_pool: bool = opt(
        True, "keep the pool file and its journal at exit, so a restart re-attaches the blocks"
    )
    fresh_pool: bool = opt(
        False,
        "start with an empty pool: delete a pool file (and journal) left by an earlier "
        "process of this node instead of re-attaching it (pegaflow-server: --fresh-pool)",
    )
    access_group: str = opt(
        "",
        "group (name or gid) given read/write access to the pool file and the same-host "
        "control socket (mode 0660), so engines running as other users in it take the "
        "same-host path; empty: owner only (0600)",
    )
    reserve_timeout_s: float = opt(30.0, "an uncommitted put's slots are reclaimed after this")
    max_request_bytes: int = opt(4 << 20, "largest data-plane control message", size=True)
    max_batch: int = opt(4096, "most blocks in one get or put")
    local_access: bool = opt(
        True,
        "let clients on this host with cluster-wide access (not tenants) read and write the "
        "pool file directly (same-host shortcut; they also need OS permission on the file)",
    )
    hash_threads: int = opt(
        0,
        "threads that hash committed blocks (xxh3 releases the GIL); 0: min(8, CPUs). "
        "Same-host writes of large prefixes are bound by this hashing",
    )
    coordinators: list[str] = opt(
        [], "coordinator addresses (informational for status)", addresses=True
    )
    hello_timeout_s: float = opt(
        5.0, "a data connection that has not said hello (authenticated) within this is closed"
    )
    max_unauthenticated: int = opt(
        256,
        "most data connections waiting for their hello at once; past it the oldest is closed",
    )
    conn_quota_share: float = opt(
        0.5,
        "share of the pool one data connection may hold reserved (puts not yet committed) "
        "and, for a tenant's connection, pinned by read pins; over it a request gets a "
        "'quota' error",
    )
    tenant_quota_share: float = opt(
        0.5,
        "the same bound for all connections of one tenant together (connections with the "
        "cluster token have the per-connection bound only)",
    )
    disk_path: str = opt(
        "",
        "directory of the disk tier under the pool: blocks evicted from memory are kept "
        "there (preallocated slab files, kept across restarts); empty: no disk tier",
    )
    disk_bytes: int = opt(16 << 30, "size of the disk tier (preallocated when it opens)", size=True)
    disk_block_bytes: int = opt(
        2 << 20,
        "largest block the disk tier keeps (each disk slot is this size, rounded up to "
        "4 KiB): the model's block size; larger blocks are not spilled",
        size=True,
    )
    disk_read_threads: int = opt(4, "threads reading the disk tier (reads in flight)")
    disk_write_threads: int = opt(2, "threads writing spills to the disk tier")
    disk_queue_bytes: int = opt(
        256 << 20,
        "memory holding evicted blocks until they are written to the disk tier; an eviction "
        "past it is not kept on disk (counted in pegaflow_node_disk_spill_drops)",
        size=True,
    )
    disk_spill_ahead_bytes: int = opt(
        256 << 20,
        "pool room kept free by writing the least recently used blocks to the disk tier in "
        "the background, so saves into a full pool pay no eviction copy; at most 1/8 of "
        "the pool; 0: off",
        size=True,
    )


@dataclass
class ClientConfig:
    """The client library (used by the vLLM connector and the tools)."""

    coordinators: list[str] = opt(
        ["127.0.0.1:7700"], "coordinator addresses, tried in order", addresses=True
    )
    local_node: str = opt("", "node id on this host, preferred for saves (empty: ask placement)")
    host: str = opt(
        "auto",
        "this client's host, sent to placement; 'auto': its address on the route to the "
        "first coordinator on another host, else 127.0.0.1",
    )
    lookup_timeout_s: float = opt(0.05, "hard deadline of one lookup")
    rpc_timeout_s: float = opt(5.0, "deadline of other control calls")
    transfer_timeout_s: float = opt(10.0, "deadline of one batched get or put")
    local_control: bool = opt(
        True, "ask a same-host node where blocks lie over its Unix control socket (else UCX)"
    )


@dataclass
class TelemetryConfig:
    """Optional OpenTelemetry export (OTLP) of metrics and traces, off by default."""

    otlp_endpoint: str = opt(
        "",
        "OTLP collector URL, e.g. http://otel-collector:4317 (grpc) or :4318 (http/protobuf);"
        " setting it turns export on (needs the otlp extra); empty: off",
    )
    otlp_protocol: str = opt("grpc", "grpc or http/protobuf")
    service_name: str = opt("", "service.name of this process (empty: the program's name)")
    export_interval_s: float = opt(15.0, "seconds between two metric exports")
    trace_sample_ratio: float = opt(1.0, "fraction of new traces kept (children follow parents)")


@dataclass
class RouterConfig:
    """``pegaflow-router``: the OpenAI-compatible proxy in front of vLLM replicas."""

    host: str = opt("127.0.0.1", "interface the router's HTTP server binds to")
    port: int = opt(7790, "the router's HTTP port (0: any free port)")
    mode: str = opt(
        "rr",
        "rr: round robin; cache: to the replica whose host's node holds the longest stored "
        "prefix; pd: prefill on a prefill replica, then decode on a decode replica",
    )
    replicas: list[str] = opt(
        [],
        "vLLM servers, each URL[;role=ROLE][;node=NODE_ID][;host=HOST]; ROLE: both "
        "(default), prefill or decode",
        metavar="URL[;KEY=VALUE...][,...]",
    )
    namespace: str = opt(
        "",
        "cache mode: the engines' PegaFlow namespace (they log 'PegaFlow namespace ...' at "
        "their first request); empty: routed by load",
    )
    tokenizer: str = opt(
        "",
        "cache mode: model or tokenizer directory for text prompts (empty: token ids only)",
        metavar="DIR",
    )
    block_size: int = opt(16, "cache mode: the engines' --block-size")
    hash_algo: str = opt("sha256", "cache mode: the engines' --prefix-caching-hash-algo")
    hash_seed: str = opt(
        "",
        "cache mode: the engines' PYTHONHASHSEED (empty: this process's, else vLLM's fixed seed)",
    )
    max_inflight: int = opt(
        64, "requests in flight on a replica past which affinity sends to the least loaded"
    )
    affinity_memory: int = opt(65536, "cache mode: recent prompts remembered with their replica")
    lookup_timeout_s: float = opt(0.2, "cache mode: deadline of the coordinator lookup")
    connect_timeout_s: float = opt(5.0, "deadline of connecting to a replica")
    read_timeout_s: float = opt(300.0, "longest wait for the next bytes of a replica's stream")
    request_timeout_s: float = opt(1800.0, "deadline of one whole upstream request (streams too)")
    prefill_timeout_s: float = opt(
        120.0, "pd mode: deadline of the prefill request; past it the decode replica recomputes"
    )
    health_interval_s: float = opt(2.0, "seconds between two health checks of every replica")
    health_timeout_s: float = opt(2.0, "deadline of one replica's /health")
    report_interval_s: float = opt(
        5.0,
        "seconds between two reports of this router's replicas and load to each [client] "
        "coordinator (pegaflow status and the dashboard list it until 3 intervals pass "
        "without one); 0: never",
    )
    retries: int = opt(
        2, "other replicas tried when one fails before any byte of its answer was sent"
    )
    max_body_bytes: int = opt(64 << 20, "largest request body accepted", size=True)
    first_byte_timeout_s: float = opt(
        120.0,
        "longest wait for the first bytes of a streamed answer (a long prompt's prefill); "
        "past it the request is retried on another replica",
    )
    eject_after: int = opt(
        3,
        "failed answers in a row (5xx, connection errors, broken or truncated streams) that "
        "take a replica out of rotation for eject_s, whatever its /health says",
    )
    eject_s: float = opt(
        10.0,
        "time out of rotation after eject_after failed answers; then one trial request, "
        "each failed trial doubling it (up to 32x)",
    )
    idle_timeout_s: float = opt(
        30.0,
        "a client connection without a request in progress for this long is closed (a "
        "request's headers must be complete within it)",
    )
    body_timeout_s: float = opt(
        60.0, "deadline of reading a request's body; past it the client gets a 408"
    )
    max_connections: int = opt(
        0,
        "client connections served at once; past it a new one gets a 503 and is closed "
        "(0: half the file descriptor limit less 64, keeping one for each upstream request)",
    )
    max_body_inflight_bytes: int = opt(
        256 << 20,
        "request body bytes held at once (read, parsed, forwarded); a request past it waits "
        "for room before its body is read",
        size=True,
    )


@dataclass
class ClusterConfig:
    """Everything one process may need, one table per component."""

    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    router: RouterConfig = field(default_factory=RouterConfig)


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(ClusterConfig)}  # type: ignore[misc]


def _section_types() -> dict[str, type]:
    hints = get_type_hints(ClusterConfig)
    return {name: hints[name] for name in SECTIONS}


def _convert(f: dataclasses.Field[Any], typ: Any, value: Any) -> Any:
    """``value`` (from TOML, the environment or a flag) as field ``f``'s type; a value
    that is not one (``maybe`` for a bool, ``1.5`` for an int) raises ``ValueError``."""
    if f.metadata.get("size"):
        return parse_size(value)
    if typ is bool:
        return parse_bool(value)
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError(f"not an integer: {value!r}")
        try:
            n = int(value.strip()) if isinstance(value, str) else int(value)
        except ValueError:
            raise ValueError(f"not an integer: {value!r}") from None
        if n != value and not isinstance(value, str):
            raise ValueError(f"not an integer: {value!r}")
        lo, hi = _PORT_RANGE
        if f.name.endswith("port") and not lo <= n <= hi:
            raise ValueError(f"not a port: {value!r} (0-65535, or -1 where it means off)")
        return n
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError(f"not a number: {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"not a number: {value!r}") from None
    if typ is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise ValueError(f"not a string: {value!r}")
        return str(value)
    if typ == list[str]:
        if f.metadata.get("addresses"):
            return parse_addresses(value)
        if isinstance(value, str):
            return [s.strip() for s in value.split(",") if s.strip()]
        if isinstance(value, list | tuple):
            return [str(s) for s in value]
        raise ValueError(f"not a list: {value!r}")
    raise ValueError(f"unsupported type {typ}")


def _coerce(f: dataclasses.Field[Any], typ: Any, value: Any, where: str) -> Any:
    try:
        return _convert(f, typ, value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config {where}: {e}") from None


def _apply(section: Any, values: dict[str, Any], where: str) -> None:
    hints = get_type_hints(type(section))
    names = {f.name: f for f in dataclasses.fields(section)}
    for key, value in values.items():
        f = names.get(key)
        if f is None:
            raise ValueError(f"config {where}: unknown option {key!r}")
        setattr(section, key, _coerce(f, hints[key], value, f"{where}.{key}"))


def _read_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ValueError(f"config file {path}: {e.strerror or e}") from None


def load_config(
    path: str | Path | None = None,
    *,
    env: dict[str, str] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    defaults: dict[str, dict[str, Any]] | None = None,
) -> ClusterConfig:
    """Build a :class:`ClusterConfig`: defaults < TOML file < environment < ``overrides``.

    ``defaults``: a program's own defaults over the schema's (``pegaflow-server`` sizes
    its pool by itself unless one is given).  Every problem (a file that cannot be read
    or parsed, an unknown option, a bad value) is a ``ValueError`` naming where it is."""
    cfg = ClusterConfig()
    for name, values in (defaults or {}).items():
        _apply(getattr(cfg, name), values, f"defaults [{name}]")
    path = path or (env or os.environ).get("PEGAFLOW_CONFIG") or None
    if path:
        for name, values in _read_toml(path).items():
            if name not in SECTIONS or not isinstance(values, dict):
                raise ValueError(
                    f"config {path}: unknown table [{name}] (tables: {', '.join(SECTIONS)})"
                )
            _apply(getattr(cfg, name), values, f"{path} [{name}]")
    env = os.environ if env is None else env
    for name in SECTIONS:
        section = getattr(cfg, name)
        prefix = f"PEGAFLOW_{name.upper()}_"
        for k, v in env.items():
            opt_name = k[len(prefix) :].lower()
            if k.startswith(prefix) and opt_name in section.__dataclass_fields__:
                _apply(section, {opt_name: v}, f"env {k}: [{name}]")
    for name, values in (overrides or {}).items():
        _apply(getattr(cfg, name), values, f"flag [{name}]")
    return cfg


class ArgParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message>`` and exit with status 2 (no usage dump)."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


_METAVARS = {
    "node_id": "NAME",
    "username": "NAME",
    "service_name": "NAME",
    "token": "SECRET",
    "password": "SECRET",
    "tenant_tokens": "TENANT=SECRET[,...]",
    "prefix": "PREFIX",
    "otlp_endpoint": "URL",
    "otlp_protocol": "PROTOCOL",
    "ucx_net_devices": "DEVICES",
}


def _metavar(f: dataclasses.Field[Any], typ: Any) -> str:
    if f.metadata.get("metavar"):
        return str(f.metadata["metavar"])
    if f.name in _METAVARS:
        return _METAVARS[f.name]
    if f.metadata.get("size"):
        return "SIZE"
    if typ is bool:
        return "BOOL"
    if f.metadata.get("addresses"):
        return "HOST:PORT[,...]"
    if f.name.endswith("_s") and typ in (int, float):
        return "SECONDS"
    if f.name.endswith("_ms") and typ in (int, float):
        return "MS"
    if typ is int:
        return "PORT" if f.name.endswith("port") else "N"
    if typ is float:
        return "NUMBER"
    if typ == list[str]:
        return "LIST"
    if f.name.endswith("host"):
        return "HOST"
    if f.name.endswith("_dir"):
        return "DIR"
    if "cert" in f.name or f.name.endswith("_key") or f.name.endswith("_path"):
        return "FILE"
    return "TEXT"


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it exactly (``64MiB``)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _show(f: dataclasses.Field[Any], typ: Any, value: Any) -> str:
    if f.metadata.get("size") and isinstance(value, int):
        return format_size(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(value) if value else "none"
    if value == "":
        return '""'
    return str(value)


def _field_default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def flag_name(section: str, name: str) -> str:
    """The command-line flag of ``[section] name``: ``--<section>-<name>``, without
    repeating the section (``[node] node_id`` is ``--node-id``)."""
    if name.startswith(section + "_"):
        return "--" + name.replace("_", "-")
    return f"--{section}-{name}".replace("_", "-")


def add_arguments(
    parser: argparse.ArgumentParser,
    sections: list[str],
    defaults: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Add ``--config`` and one flag per option of the given sections (see
    :func:`flag_name`; ``--<section>-<name>`` stays accepted where it differs).  Values
    are checked as they are parsed, so a bad one is an error naming its flag.
    ``defaults``: a program's own defaults (shown in the help)."""
    parser.add_argument("--config", metavar="FILE", help="TOML config file (also PEGAFLOW_CONFIG)")
    for name in sections:
        group = parser.add_argument_group(f"[{name}] (env PEGAFLOW_{name.upper()}_<OPTION>)")
        section = getattr(ClusterConfig(), name)
        hints = get_type_hints(type(section))
        for f in dataclasses.fields(section):
            typ = hints[f.name]

            def convert(value: str, f: dataclasses.Field[Any] = f, typ: Any = typ) -> Any:
                try:
                    return _convert(f, typ, value)
                except (TypeError, ValueError) as e:
                    raise argparse.ArgumentTypeError(str(e)) from None

            default = (defaults or {}).get(name, {}).get(f.name, _field_default(f))
            help_text = f"{f.metadata['help']} (default: {_show(f, typ, default)})"
            kw: dict[str, Any] = {
                "dest": f"{name}__{f.name}",
                "default": None,
                "type": convert,
                "metavar": _metavar(f, typ),
            }
            if typ is bool:  # a bare --node-keep-pool means true
                kw.update(nargs="?", const=True)
            flag = flag_name(name, f.name)
            group.add_argument(flag, help=help_text.replace("%", "%%"), **kw)
            long = f"--{name}-{f.name}".replace("_", "-")
            if long != flag:  # the old spelling, kept working, not shown
                group.add_argument(long, help=argparse.SUPPRESS, **kw)


def config_from_args(
    args: argparse.Namespace, defaults: dict[str, dict[str, Any]] | None = None
) -> ClusterConfig:
    """The config named by ``--config`` with the flags that were given applied on top
    (``defaults``: see :func:`load_config`)."""
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "__" in key and value is not None:
            section, name = key.split("__", 1)
            overrides.setdefault(section, {})[name] = value
    return load_config(getattr(args, "config", None), overrides=overrides, defaults=defaults)


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md), generated from the schema."""
    out = [
        "# Configuration reference",
        "",
        "Generated by `python -m pegaflow.config` from `pegaflow/config.py`; do not edit.",
        "",
        "Precedence: defaults < TOML file (`--config` or `PEGAFLOW_CONFIG`) <",
        "environment `PEGAFLOW_<TABLE>_<OPTION>` < command-line `--<table>-<option>`.",
        "Flags: `--<table>-<option>`, the table not repeated (`[node] node_id` is `--node-id`).",
        "Booleans: `true`/`false`, `yes`/`no`, `on`/`off`, `1`/`0`; anything else is an error.",
        f"Sizes: {SIZE_RULE}.",
        "Lists accept comma-separated strings.",
        "",
    ]
    hints_by_section = _section_types()
    for name, cls in hints_by_section.items():
        out += [f"## `[{name}]`", "", (cls.__doc__ or "").strip(), ""]
        out += ["| option | default | flag | env | meaning |", "|---|---|---|---|---|"]
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = _show(f, hints[f.name], _field_default(f))
            env = f"PEGAFLOW_{name.upper()}_{f.name.upper()}"
            flag = f"{flag_name(name, f.name)} {_metavar(f, hints[f.name])}"
            out.append(f"| `{f.name}` | `{default}` | `{flag}` | `{env}` | {f.metadata['help']} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())
