"""Configuration of every component: one dataclass each, loaded from TOML, then
``PEGAFLOW_*`` environment variables, then command-line flags (last wins).

Each field's ``metadata["help"]`` documents it; :func:`add_arguments` turns the fields
into argparse flags and ``docs/configuration.md`` is generated from the same schema
(``python -m pegaflow.config``), so flags, env vars and docs cannot drift apart.

A TOML file has one table per component: ``[etcd]``, ``[coordinator]``, ``[node]``,
``[client]``, ``[security]``, ``[telemetry]``.  Environment variables are
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
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(v: str | int) -> int:
    """``"8GiB"``, ``"512M"``, ``"4096"`` or an int into bytes."""
    if isinstance(v, int):
        return v
    m = _SIZE_RE.match(v)
    if not m:
        raise ValueError(f"not a size: {v!r} (use e.g. 512MiB, 8GiB)")
    unit = (m.group(2) or "").upper()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


def opt(default: Any, help: str, *, size: bool = False) -> Any:
    """A documented config field (``size=True``: accepts ``"8GiB"`` style values)."""
    meta = {"help": help, "size": size}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class EtcdConfig:
    """Connection to the etcd v3 cluster that holds membership and the index."""

    endpoints: list[str] = opt(
        [], "etcd client endpoints, host:port; empty = no etcd (single-host mode only)"
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

    host: str = opt("127.0.0.1", "interface the control protocol binds to")
    port: int = opt(7700, "control protocol port (0: any free port)")
    http_host: str = opt("127.0.0.1", "interface of the HTTP endpoint (/health, /metrics)")
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


@dataclass
class NodeConfig:
    """A storage node: a shared-memory block pool served over UCX."""

    node_id: str = opt("", "unique node name (empty: <hostname>-<ucx port>)")
    host: str = opt(
        "127.0.0.1",
        "interface this node's data plane binds to (its UCX handshake socket; UCX's own "
        "transports follow ucx_net_devices) and the address clients use to reach it",
    )
    ucx_port: int = opt(7800, "UCX listener port (0: any free port)")
    ucx_net_devices: str = opt(
        "auto",
        "network devices UCX may use and accept connections on (UCX_NET_DEVICES); 'auto': "
        "the interface that owns [node] host plus every RDMA device, so a loopback node "
        "refuses connections from other hosts; 'all': every device; else a UCX device list",
    )
    http_host: str = opt("127.0.0.1", "interface of the HTTP endpoint")
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
    coordinators: list[str] = opt([], "coordinator addresses (informational for status)")
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


@dataclass
class ClientConfig:
    """The client library (used by the vLLM connector and the tools)."""

    coordinators: list[str] = opt(["127.0.0.1:7700"], "coordinator addresses, tried in order")
    local_node: str = opt("", "node id on this host, preferred for saves (empty: ask placement)")
    host: str = opt("127.0.0.1", "this client's host, sent to placement")
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
class ClusterConfig:
    """Everything one process may need, one table per component."""

    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(ClusterConfig)}  # type: ignore[misc]


def _section_types() -> dict[str, type]:
    hints = get_type_hints(ClusterConfig)
    return {name: hints[name] for name in SECTIONS}


def _coerce(f: dataclasses.Field[Any], typ: Any, value: Any, where: str) -> Any:
    try:
        if f.metadata.get("size"):
            return parse_size(value)
        if typ is bool:
            if isinstance(value, str):
                return value.strip().lower() in ("1", "true", "yes", "on")
            return bool(value)
        if typ in (int, float):
            return typ(value)
        if typ is str:
            return str(value)
        if typ == list[str]:
            if isinstance(value, str):
                return [s.strip() for s in value.split(",") if s.strip()]
            return [str(s) for s in value]
    except (TypeError, ValueError) as e:
        raise ValueError(f"config {where}: {e}") from None
    raise ValueError(f"config {where}: unsupported type {typ}")


def _apply(section: Any, values: dict[str, Any], where: str) -> None:
    hints = get_type_hints(type(section))
    names = {f.name: f for f in dataclasses.fields(section)}
    for key, value in values.items():
        f = names.get(key)
        if f is None:
            raise ValueError(f"config {where}: unknown option {key!r}")
        setattr(section, key, _coerce(f, hints[key], value, f"{where}.{key}"))


def load_config(
    path: str | Path | None = None,
    *,
    env: dict[str, str] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    defaults: dict[str, dict[str, Any]] | None = None,
) -> ClusterConfig:
    """Build a :class:`ClusterConfig`: defaults < TOML file < environment < ``overrides``.

    ``defaults``: a program's own defaults over the schema's (``pegaflow-server`` sizes
    its pool by itself unless one is given)."""
    cfg = ClusterConfig()
    for name, values in (defaults or {}).items():
        _apply(getattr(cfg, name), values, f"defaults [{name}]")
    path = path or (env or os.environ).get("PEGAFLOW_CONFIG") or None
    if path:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        for name, values in data.items():
            if name not in SECTIONS or not isinstance(values, dict):
                raise ValueError(f"config {path}: unknown table [{name}]")
            _apply(getattr(cfg, name), values, f"{path} [{name}]")
    env = os.environ if env is None else env
    for name in SECTIONS:
        section = getattr(cfg, name)
        prefix = f"PEGAFLOW_{name.upper()}_"
        vals = {
            k[len(prefix) :].lower(): v
            for k, v in env.items()
            if k.startswith(prefix) and k[len(prefix) :].lower() in section.__dataclass_fields__
        }
        _apply(section, vals, f"env {prefix}*")
    for name, values in (overrides or {}).items():
        _apply(getattr(cfg, name), values, f"flag [{name}]")
    return cfg


def add_arguments(parser: argparse.ArgumentParser, sections: list[str]) -> None:
    """Add ``--<section>-<field>`` flags (and ``--config``) for the given sections."""
    parser.add_argument("--config", help="TOML config file (also PEGAFLOW_CONFIG)")
    for name in sections:
        group = parser.add_argument_group(f"[{name}]")
        for f in dataclasses.fields(getattr(ClusterConfig(), name)):
            flag = f"--{name}-{f.name}".replace("_", "-")
            group.add_argument(
                flag, dest=f"{name}__{f.name}", default=None, help=f.metadata["help"]
            )


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
    return load_config(args.config, overrides=overrides, defaults=defaults)


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md), generated from the schema."""
    out = [
        "# Configuration reference",
        "",
        "Generated by `python -m pegaflow.config` from `pegaflow/config.py`; do not edit.",
        "",
        "Precedence: defaults < TOML file (`--config` or `PEGAFLOW_CONFIG`) <",
        "environment `PEGAFLOW_<TABLE>_<OPTION>` < command-line `--<table>-<option>`.",
        "Sizes accept `KiB`/`MiB`/`GiB` suffixes; lists accept comma-separated strings.",
        "",
    ]
    hints_by_section = _section_types()
    for name, cls in hints_by_section.items():
        out += [f"## `[{name}]`", "", (cls.__doc__ or "").strip(), ""]
        out += ["| option | default | env | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            )
            env = f"PEGAFLOW_{name.upper()}_{f.name.upper()}"
            out.append(f"| `{f.name}` | `{default!r}` | `{env}` | {f.metadata['help']} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())
