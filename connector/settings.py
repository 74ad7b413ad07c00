"""Settings of the vLLM connector: ``kv_connector_extra_config`` first, then ``PEGAFLOW_*``.

The connector is configured where vLLM users expect it, in the ``--kv-transfer-config``
JSON::

    {"kv_connector": "PegaKVConnector", "kv_role": "kv_both",
     "kv_connector_module_path": "pegaflow.connector",
     "kv_connector_extra_config": {"coordinators": "10.0.0.1:7700,10.0.0.2:7700",
                                   "local_node": "host-a", "mode": "read_write"}}

Every key may instead come from the environment as ``PEGAFLOW_CONNECTOR_<KEY>``
(upper case).  The shared client variables ``PEGAFLOW_CLIENT_COORDINATORS``,
``PEGAFLOW_CLIENT_LOCAL_NODE``, ``PEGAFLOW_SECURITY_TOKEN``,
``PEGAFLOW_SECURITY_TOKEN_FILE`` and ``PEGAFLOW_SECURITY_TLS_CA`` of
:mod:`pegaflow.config` are honoured too, so one environment configures every
PegaFlow process on a host.  Precedence: extra config > ``PEGAFLOW_CONNECTOR_*`` >
``PEGAFLOW_CLIENT_*`` / ``PEGAFLOW_SECURITY_*`` > defaults.

PegaFlow's own keys are read too, so a ``--kv-transfer-config`` written for PegaFlow
works unchanged (see :data:`PEGAFLOW_KEYS`): ``pegaflow.host`` and ``pegaflow.port``
(or the environment ``PEGAFLOW_HOST`` / ``PEGAFLOW_PORT``) become ``coordinators``,
``pegaflow.mode`` is ``mode``, and the keys that have no counterpart here are accepted
and ignored.  Each is named once per process in the log with the key to use instead.

This module has no vLLM dependency (it is unit-tested without an engine).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pegaflow.config import (
    ClientConfig,
    ConfigError,
    SecurityConfig,
    Source,
    build,
    check_address,
    env_sources,
    opt,
    same_option,
)

log = logging.getLogger("pegaflow.connector")

Mode = Literal["read_write", "save_only", "load_only", "off"]
_MODES: tuple[str, ...] = ("read_write", "save_only", "load_only", "off")
KV_ROLES: tuple[str, ...] = ("kv_both", "kv_producer", "kv_consumer")
"""vLLM's ``kv_role`` values: a producer (prefill) saves and never loads; a consumer
(decode) loads and saves nothing but, with ``save_decode_blocks``, its decode blocks"""

DEFAULT_COORDINATOR_PORT = 7700
"""the port of a ``pegaflow.host`` given without ``pegaflow.port`` (PegaFlow's own
default, :data:`PEGAFLOW_SERVER_PORT`, is its server's, not a coordinator's)"""
PEGAFLOW_SERVER_PORT = 50055
"""PegaFlow's server port: a config written for PegaFlow names it, and nothing of this
cluster listens there unless told to (a warning says so)"""

PEGAFLOW_KEYS: dict[str, str] = {
    "pegaflow.host": "coordinators",
    "pegaflow.port": "coordinators",
    "pegaflow.mode": "mode",
    "pegaflow.transfer_backend": "",
    "pegaflow.wait_for_full_prefix": "",
    "pegaflow.tp_shard_endpoints": "",
    "pegaflow.pd_tail_save": "",
    "pegaflow.pd_tail_load": "",
}
"""PegaFlow 0.25's ``kv_connector_extra_config`` keys and the setting each maps onto
("": none here; the key is accepted and ignored: the cluster places every TP shard's
blocks and transfers by itself)."""

_WHERE = "PegaKVConnector setting "
"""how errors name a setting's source"""

_noticed: set[str] = set()
_noticed_lock = threading.Lock()


def _notice_once(key: str, level: int, msg: str, *args: object) -> None:
    with _noticed_lock:
        if key in _noticed:
            return
        _noticed.add(key)
    log.log(level, msg, *args)


def _pegaflow_coordinator(host: Any, port: Any, where: str) -> str:
    """``host``/``port`` as PegaFlow spells them (``http://10.0.0.1``, ``50055``) as one
    coordinator address; :class:`ConfigError` if they do not make one."""
    h = str(host if host is not None else "127.0.0.1").strip()
    for scheme in ("http://", "https://", "grpc://"):
        if h.lower().startswith(scheme):
            h = h[len(scheme) :]
    h = h.rstrip("/")
    head, sep, tail = h.rpartition(":")
    try:
        if port is None and sep and tail.isdigit() and "]" not in tail:
            h, port = head, tail  # host:port already
        if port is None:
            port = DEFAULT_COORDINATOR_PORT
        if isinstance(port, bool) or not str(port).strip().isdigit():
            raise ValueError(f"not a port: {port!r}")
        if ":" in h and not h.startswith("["):
            h = f"[{h}]"
        addr = check_address(f"{h}:{int(port)}")
    except ValueError as e:
        raise ConfigError(f"{_WHERE}{where}", str(e)) from None
    if int(port) == PEGAFLOW_SERVER_PORT:
        _notice_once(
            f"port {where}",
            logging.WARNING,
            "PegaFlow's %s names port %d, PegaFlow's server port, read as coordinator %s: "
            "no PegaFlow cluster service listens on %d unless started with it (a coordinator "
            "and pegaflow-server listen on %d); point it at a coordinator instead, e.g. "
            '"coordinators": "%s:%d"',
            where, PEGAFLOW_SERVER_PORT, addr, PEGAFLOW_SERVER_PORT,
            DEFAULT_COORDINATOR_PORT, h, DEFAULT_COORDINATOR_PORT,
        )  # fmt: skip
    return addr

def _translate_pegaflow(
    extra: dict[str, Any], env: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Split PegaFlow's keys off ``extra``: ``(extra without them, our settings from
    them, our settings from PegaFlow's environment)``; the last come from
    ``PEGAFLOW_HOST``/``PEGAFLOW_PORT`` and have the lowest precedence."""
    ours = {k: v for k, v in extra.items() if k not in PEGAFLOW_KEYS}
    theirs = {k: v for k, v in extra.items() if k in PEGAFLOW_KEYS}
    mapped: dict[str, Any] = {}
    if "pegaflow.host" in theirs or "pegaflow.port" in theirs:
        if "coordinators" in ours:
            raise ConfigError(
                f"{_WHERE}kv_connector_extra_config",
                "both 'coordinators' and PegaFlow's 'pegaflow.host'/'pegaflow.port': "
                "keep 'coordinators' only",
            )
        addr = _pegaflow_coordinator(
            theirs.get("pegaflow.host"), theirs.get("pegaflow.port"), "pegaflow.host/port"
        )
        mapped["coordinators"] = [addr]
        _notice_once(
            "pegaflow.host",
            logging.INFO,
            "PegaFlow's 'pegaflow.host'/'pegaflow.port' read as coordinators=[%r]; "
            'write "coordinators": "%s" instead (a list may name several)',
            addr,
            addr,
        )
    if "pegaflow.mode" in theirs:
        if "mode" in ours:
            raise ConfigError(
                f"{_WHERE}kv_connector_extra_config",
                "both 'mode' and PegaFlow's 'pegaflow.mode': keep 'mode' only",
            )
        mapped["mode"] = theirs["pegaflow.mode"]
        _notice_once(
            "pegaflow.mode",
            logging.INFO,
            "PegaFlow's 'pegaflow.mode' read as mode=%r; write \"mode\" instead",
            theirs["pegaflow.mode"],
        )
    for key in sorted(k for k in theirs if not PEGAFLOW_KEYS[k]):
        _notice_once(
            key,
            logging.WARNING,
            "PegaFlow's '%s' has no counterpart in this connector and is ignored (the "
            "cluster places and transfers every shard's blocks itself); remove it",
            key,
        )
    from_env: dict[str, Any] = {}
    if env.get("PEGAFLOW_HOST") or env.get("PEGAFLOW_PORT"):
        addr = _pegaflow_coordinator(
            env.get("PEGAFLOW_HOST") or None,
            env.get("PEGAFLOW_PORT") or None,
            "env PEGAFLOW_HOST/PEGAFLOW_PORT",
        )
        from_env["coordinators"] = [addr]
        _notice_once(
            "PEGAFLOW_HOST",
            logging.INFO,
            "PegaFlow's PEGAFLOW_HOST/PEGAFLOW_PORT read as coordinators=[%r] (unless "
            "coordinators are set otherwise); set PEGAFLOW_CLIENT_COORDINATORS=%s instead",
            addr,
            addr,
        )
    return ours, mapped, from_env


_CLIENT_KEYS = (
    "coordinators",
    "local_node",
    "host",
    "lookup_timeout_s",
    "rpc_timeout_s",
    "transfer_timeout_s",
)
"""settings that are also ``[client]`` options (``PEGAFLOW_CLIENT_<KEY>``)"""


_SECURITY_KEYS = ("token", "token_file", "tls_ca")
"""settings that are also ``[security]`` options (``PEGAFLOW_SECURITY_<KEY>``)"""


def client_option(name: str, help: str = "") -> Any:
    """A setting declared as ``[client] name`` is (see :func:`same_option`)."""
    return same_option(ClientConfig, name, help)


@dataclass(frozen=True)
class ConnectorSettings:
    """Everything the connector needs; one field per ``kv_connector_extra_config`` key."""

    coordinators: list[str] = client_option(
        "coordinators", "coordinator addresses host:port, tried in order (list or comma string)"
    )
    local_node: str = client_option(
        "local_node",
        "node id on this host; saves go there and its hits load straight from its pool "
        "file (empty: found by itself, the node whose pool file this host can open)",
    )
    host: str = client_option(
        "host",
        "this host's address, sent to placement ('auto': the address on the route to the "
        "first coordinator on another host, else 127.0.0.1)",
    )
    token: str = opt(
        "",
        "shared secret of the cluster (also PEGAFLOW_SECURITY_TOKEN); in --kv-transfer-config "
        "every user sees it in ps: prefer token_file or the environment",
    )
    token_file: str = same_option(SecurityConfig, "token_file")
    tls_ca: str = same_option(SecurityConfig, "tls_ca")
    mode: str = opt("read_write", "read_write, save_only, load_only or off")
    namespace_extra: str = opt(
        "", "extra text folded into the namespace (e.g. weights revision) to keep caches apart"
    )
    model_id: str = opt("", "model identity for the namespace (default: vLLM's model name/path)")
    lookup_timeout_s: float = client_option(
        "lookup_timeout_s", "hard deadline of one lookup; on expiry the answer is 0 hits"
    )
    rpc_timeout_s: float = client_option("rpc_timeout_s")
    transfer_timeout_s: float = client_option("transfer_timeout_s")
    load_budget_factor: float = opt(
        0.8,
        "a load from another host may wait this many times what computing its tokens is "
        "expected to take (the cost model's estimate), then its blocks are computed: a "
        "cut-off or hung node costs a request about one recompute, not transfer_timeout_s "
        "(never more than transfer_timeout_s; the first load from a node, which also sets "
        "up the connection, gets 1 s more); 0: transfer_timeout_s always",
    )
    load_budget_min_s: float = opt(
        0.05, "least time a load from another host may wait (see load_budget_factor)"
    )
    lookup_cache_s: float = opt(
        1.0, "a request asked again within this many seconds reuses its last lookup"
    )
    backoff_s: float = opt(1.0, "first pause after consecutive cluster failures (doubles)")
    backoff_max_s: float = opt(30.0, "longest pause of the failure backoff")
    failures_to_backoff: int = opt(3, "consecutive failures that open the circuit breaker")
    save_decode_blocks: bool = opt(
        False,
        "also save blocks filled by generated tokens (default: prompt blocks only); on a "
        "kv_consumer, save those and nothing else",
    )
    window_anchor_tokens: int = opt(
        2048,
        "hybrid models (vLLM's hybrid KV cache manager): a sliding-window group's blocks "
        "are stored in the window before each point where a request's saves stop, and "
        "before every multiple of this many tokens, where a prompt sharing only part of "
        "a request's prefix can hit; 0: only where saves stop",
    )
    handoff_wait_s: float = opt(
        2.0,
        "kv_consumer: how long a request given a producer's handoff waits for its blocks "
        "still being committed (other requests are served meanwhile); then what is stored "
        "is loaded and the rest computed",
    )
    handoff_ttl_s: float = opt(
        60.0, "kv_producer: how long after a request the handoff it returns stays valid"
    )
    chunk_bytes: int = opt(
        8 << 20,
        "bytes per transfer chunk (a load keeps up to 3 in flight while copying)",
        size=True,
    )
    max_staging_bytes: int = opt(
        1 << 30,
        "host staging memory for transfers; saves beyond it are dropped, loads wait",
        size=True,
    )
    read_pin_s: float = opt(
        5.0,
        "after a hit, ask the nodes to keep the blocks from eviction this long (until the "
        "load); 0: no read pins",
    )
    recompute_failed_loads: bool = opt(
        True,
        "a block that cannot be loaded (node lost, evicted, corrupt) is recomputed: the "
        "connector sets vLLM's kv_load_failure_policy to recompute; off: vLLM's policy as "
        "given (its default, fail, ends such a request with an error)",
    )
    same_host_shortcut: bool = opt(
        True,
        "copy blocks straight between the KV cache and local_node's pool file when that "
        "node runs on this host (no UCX hop); off: always UCX",
    )
    layerwise: bool = opt(
        True,
        "hits held wholly by local_node (same host) load during the forward pass, each "
        "layer waited for on its own; off: every load is asynchronous",
    )
    early_start: bool = opt(
        True,
        "with one rank (the worker in vLLM's scheduler process), queue a step's layer-wise "
        "copies before vLLM launches the step: each request's as vLLM allocates its blocks "
        "where it replays CUDA graphs, else the step's when it is planned; off: when vLLM "
        "launches the step",
    )
    load_lookahead_layers: int = opt(
        2,
        "in a step of a size the engine has not run yet (and replays no CUDA graph of), "
        "layer-wise loads queue this many layers ahead of the forward pass, the rest as it "
        "reaches them (CUDA loads a new shape's kernels lazily, which waits for every copy "
        "in flight); 0: all at once",
    )
    verify_threads: int = opt(
        0, "CPU threads that check checksums of same-host loads (0: min(16, cpus))"
    )
    idle_wait_s: float = opt(
        0.02, "in engine steps that only wait for loads, block this long for one to land"
    )
    known_blocks: int = opt(
        200_000, "hashes remembered as stored in the cluster (skips redundant saves)"
    )
    cost_model: bool = opt(
        True,
        "claim only hits whose load is expected to be faster than computing them (the "
        "whole hit, a leading part or nothing), from measured load and prefill costs; "
        "off: claim every hit",
    )
    report_interval_s: float = opt(
        10.0,
        "seconds between two 'PegaFlow cache:' lines in the engine log (lookups, hit rate, "
        "loads, saves, drops, failures), printed only when something happened, and between "
        "two reports of this engine's misses by cause to a coordinator; 0: never",
    )
    shutdown_wait_s: float = opt(
        10.0,
        "at engine shutdown, how long pending saves may take to finish; those still "
        "pending after it are dropped (counted, and logged as a warning)",
    )
    stats_path: str = opt(
        "", "write connector counters as JSON to <path>.<role><rank>.json (tests, debugging)"
    )
    log_level: str = opt(
        "",
        "level of the connector's log ('debug': one line per lookup and per layer-wise load, "
        "with timings); empty: as the engine sets it",
    )
    kv_role: str = field(
        default="kv_both",
        metadata={
            "help": "vLLM's kv_role (from --kv-transfer-config, not an extra key)",
            "vllm": True,
        },
    )

    # ---- derived -------------------------------------------------------------------

    @property
    def can_load(self) -> bool:
        """Whether lookups and loads are enabled (never on a ``kv_producer``)."""
        return self.mode in ("read_write", "load_only") and self.kv_role != "kv_producer"

    @property
    def can_save(self) -> bool:
        """Whether saves are enabled (on a ``kv_consumer`` only with
        ``save_decode_blocks``)."""
        if self.kv_role == "kv_consumer" and not self.save_decode_blocks:
            return False
        return self.mode in ("read_write", "save_only")

    @property
    def saves_prompt(self) -> bool:
        """Whether prompt blocks are saved (a consumer's came from its producer)."""
        return self.kv_role != "kv_consumer"

    @property
    def hands_off(self) -> bool:
        """Whether finished requests return a handoff (``kv_producer`` that saves)."""
        return self.kv_role == "kv_producer" and self.can_save

    @classmethod
    def keys(cls) -> list[str]:
        """The accepted ``kv_connector_extra_config`` keys."""
        return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("vllm")]

    @classmethod
    def load(
        cls,
        extra: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        kv_role: str | None = None,
    ) -> ConnectorSettings:
        """Build settings from vLLM's extra config, the environment and ``kv_role``.

        Unknown extra-config keys raise :class:`ConfigError`, a ``ValueError`` (a typo
        must not silently fall back to a default); so do malformed values, an unknown
        ``mode`` and an unknown ``kv_role`` (None: ``kv_both``).
        """
        env = os.environ if env is None else env
        extra, from_pegaflow, from_pegaflow_env = _translate_pegaflow(dict(extra or {}), env)
        if kv_role is not None and kv_role not in KV_ROLES:
            raise ConfigError(f"{_WHERE}kv_role", f"one of {KV_ROLES}, not {kv_role!r}")
        keys = cls.keys()
        unknown = sorted(set(extra) - set(keys))
        if unknown:
            raise ConfigError(
                f"{_WHERE}kv_connector_extra_config",
                f"unknown option(s) {unknown}; known: {sorted(keys)} (and PegaFlow's "
                f"{sorted(PEGAFLOW_KEYS)})",
            )
        sources: list[Source] = [  # lowest precedence first
            (f"{_WHERE}env PEGAFLOW_HOST/PEGAFLOW_PORT", from_pegaflow_env),
            *env_sources(env, "client", _CLIENT_KEYS, _WHERE),
            *env_sources(env, "security", _SECURITY_KEYS, _WHERE),
            *env_sources(env, "connector", keys, _WHERE),
            (f"{_WHERE}kv_connector_extra_config (PegaFlow's keys)", from_pegaflow),
            (f"{_WHERE}kv_connector_extra_config", extra),
            ("vLLM", {} if kv_role is None else {"kv_role": kv_role}),
        ]
        s = build(cls, sources)
        s._check()
        if extra.get("token"):
            log.warning(
                "PegaFlow: the cluster token is in --kv-transfer-config, where every user "
                "of this host sees it (ps): put it in a file (token_file) or in "
                "PEGAFLOW_SECURITY_TOKEN"
            )
        return s

    def _check(self) -> None:
        """:class:`ConfigError` for values of their type that no connector can run with."""
        if self.mode not in _MODES:
            raise ConfigError(f"{_WHERE}mode", f"one of {_MODES}, not {self.mode!r}")
        if not self.coordinators and self.mode != "off":
            raise ConfigError(f"{_WHERE}coordinators", "at least one address is needed")
        for name in ("lookup_timeout_s", "rpc_timeout_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_WHERE}{name}", "must be > 0")
        names = ("report_interval_s", "shutdown_wait_s", "handoff_wait_s", "handoff_ttl_s")
        names += ("load_budget_factor", "load_budget_min_s", "load_lookahead_layers")
        for name in names:
            if getattr(self, name) < 0:
                raise ConfigError(f"{_WHERE}{name}", "must be >= 0")
        for name in ("chunk_bytes", "max_staging_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_WHERE}{name}", "must be > 0")

    def client_config(self) -> ClientConfig:
        """The ``[client]`` options of these settings, for the connector's client."""
        values = {k: getattr(self, k) for k in _CLIENT_KEYS}
        return ClientConfig(**{**values, "coordinators": list(self.coordinators)})

    def security(self) -> SecurityConfig:
        """The ``[security]`` options of these settings, for the connector's client."""
        return SecurityConfig(**{k: getattr(self, k) for k in _SECURITY_KEYS})

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict with the token hidden (for logs)."""
        d = dataclasses.asdict(self)
        if d.get("token"):
            d["token"] = "***"
        return d

