"""The configuration schema: one frozen dataclass per component, one field per option.

Each field's ``metadata["help"]`` documents it; :mod:`.flags` turns the fields into
argparse flags and ``docs/configuration.md`` is generated from the same schema
(``python -m pegaflow.config``), so flags, env vars and docs cannot drift apart.

A TOML file has one table per component: ``[etcd]``, ``[coordinator]``, ``[node]``,
``[client]``, ``[security]``, ``[telemetry]``, ``[router]``.  Environment variables are
``PEGAFLOW_<TABLE>_<FIELD>``, e.g. ``PEGAFLOW_NODE_POOL_BYTES=8GiB``.  Every object is
frozen: a value decided from others (a host, the pool size) is built into a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_type_hints

from .values import opt


@dataclass(frozen=True)
class EtcdConfig:
    """Connection to the etcd v3 cluster that holds membership and the index."""

    endpoints: list[str] = opt(
        [],
        "etcd client endpoints, host:port; empty = no etcd (single-host mode only)",
        addresses=True,
    )
    prefix: str = opt("/pegaflow/default", "key prefix of this cluster in etcd")
    username: str = opt("", "etcd user name (empty: no authentication)")
    password: str = opt(
        "", "etcd password; from the config file or the environment only (use password_file)",
        secret=True,
    )
    password_file: str = opt(
        "", "file holding the etcd password (its first line; keep it mode 0600); excludes password"
    )
    ca_cert: str = opt("", "CA certificate file for TLS to etcd")
    cert_cert: str = opt("", "client certificate file for TLS to etcd")
    cert_key: str = opt("", "client key file for TLS to etcd")
    lease_ttl_s: int = opt(10, "TTL of a node's lease; its entries vanish this long after it dies")
    timeout_s: float = opt(5.0, "deadline of one etcd call")
    batch_size: int = opt(128, "puts per etcd transaction (etcd's --max-txn-ops caps it)")
    flush_interval_ms: int = opt(5, "how long index writes wait to fill a batch")


@dataclass(frozen=True)
class SecurityConfig:
    """Shared-secret authentication of the control and data planes; TLS of the control
    protocol and the HTTP endpoints (docs/operations.md, "Security")."""

    token: str = opt(
        "",
        "shared secret required on every connection (empty: none); from the config file or "
        "the environment only, never a flag (use token_file)",
        secret=True,
    )
    token_file: str = opt(
        "", "file holding the shared secret (its first line; keep it mode 0600); excludes token"
    )
    tenant_tokens: list[str] = opt(
        [],
        "tenant secrets, 'tenant=secret': such a connection may only use namespaces "
        "'tenant@...'; from the config file or the environment only (use tenant_tokens_file)",
        secret=True,
    )
    tenant_tokens_file: str = opt(
        "",
        "file of tenant secrets, one 'tenant=secret' a line ('#' comments); excludes "
        "tenant_tokens",
    )
    tls_cert: str = opt(
        "",
        "certificate (PEM, chain first) this process's servers present: the control "
        "protocol's TCP port and the HTTP endpoint turn to TLS (with tls_key; empty: plain)",
    )
    tls_key: str = opt("", "private key (PEM) of tls_cert")
    tls_ca: str = opt(
        "",
        "CA certificates (PEM) a client verifies servers by: set, every connection to a "
        "coordinator and every HTTP request to a node is TLS, the server's name or address "
        "checked against its certificate (empty: plain)",
    )


@dataclass(frozen=True)
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
    huge_pages: bool = opt(
        True,
        "back the index's hash tables with transparent huge pages (fewer TLB misses per "
        "lookup at millions of blocks): on Linux with glibc >= 2.35 and THP not 'never', "
        "the process re-executes itself once at start with GLIBC_TUNABLES=glibc.malloc.hugetlb=1",
    )


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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
        "vLLM servers, each URL[;role=ROLE][;node=NODE_ID][;host=HOST][;events=ZMQ]"
        "[;replay=ZMQ]; ROLE: both (default), prefill or decode; events/replay: the "
        "engine's --kv-events-config endpoint and replay_endpoint as the router reaches "
        "them (tcp://HOST:PORT; cache mode)",
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
    events_max_blocks: int = opt(
        262144, "cache mode: block hashes kept per replica from its KV events (oldest forgotten)"
    )
    events_stale_s: float = opt(
        2.0,
        "cache mode: a replica's KV event view is not used while a request was sent to it "
        "more than this long ago with no event batch or replay answer since",
    )
    events_timeout_s: float = opt(1.0, "cache mode: deadline of a KV event replay request")
    events_topic: str = opt("", "cache mode: the engines' --kv-events-config topic")
    pool_weight: float = opt(
        0.89,
        "cache mode: what a prefix block on the replica's host's node saves, as a share of "
        "one in its own GPU cache",
    )
    remote_weight: float = opt(
        0.67,
        "cache mode: what a prefix block on another node saves, as a share of one in the "
        "replica's own GPU cache",
    )
    queue_weight: float = opt(
        1.0,
        "cache mode: what one prompt block of prefill queued on a replica (sent, no answer "
        "yet) costs, in prefix blocks held (0: the queue is not priced)",
    )
    load_blocks: float = opt(
        0.0,
        "cache mode: what one request in flight on a replica costs, in prefix blocks held "
        "(0: load only breaks ties)",
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


@dataclass(frozen=True)
class ClusterConfig:
    """Everything one process may need, one table per component."""

    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    router: RouterConfig = field(default_factory=RouterConfig)


SECTIONS: dict[str, type] = get_type_hints(ClusterConfig)
"""the tables of a config file, in order, and the dataclass of each"""
