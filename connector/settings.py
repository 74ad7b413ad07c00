"""Settings of the vLLM connector: ``kv_connector_extra_config`` first, then ``PEGAFLOW_*``.

The connector is configured where vLLM users expect it, in the ``--kv-transfer-config``
JSON::

    {"kv_connector": "PegaKVConnector", "kv_role": "kv_both",
     "kv_connector_module_path": "pegaflow.connector",
     "kv_connector_extra_config": {"coordinators": "10.0.0.1:7700,10.0.0.2:7700",
                                   "local_node": "host-a", "mode": "read_write"}}

Every key may instead come from the environment as ``PEGAFLOW_CONNECTOR_<KEY>``
(upper case).  The shared client variables ``PEGAFLOW_CLIENT_COORDINATORS``,
``PEGAFLOW_CLIENT_LOCAL_NODE`` and ``PEGAFLOW_SECURITY_TOKEN`` of
:mod:`pegaflow.config` are honoured too, so one environment configures every
PegaFlow process on a host.  Precedence: extra config > ``PEGAFLOW_CONNECTOR_*`` >
``PEGAFLOW_CLIENT_*`` / ``PEGAFLOW_SECURITY_*`` > defaults.

This module has no vLLM dependency (it is unit-tested without an engine).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_type_hints

Mode = Literal["read_write", "save_only", "load_only", "off"]
_MODES: tuple[str, ...] = ("read_write", "save_only", "load_only", "off")


def _f(default: str | int | float | bool, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class ConnectorSettings:
    """Everything the connector needs; one field per ``kv_connector_extra_config`` key."""

    coordinators: list[str] = field(
        default_factory=lambda: ["127.0.0.1:7700"],
        metadata={"help": "coordinator addresses host:port, tried in order (list or comma string)"},
    )
    local_node: str = _f(
        "",
        "node id on this host; saves go there and its hits load straight from its pool "
        "file (empty: found by itself, the node whose pool file this host can open)",
    )
    host: str = _f("127.0.0.1", "this host's address, sent to placement")
    token: str = _f("", "shared secret of the cluster (also PEGAFLOW_SECURITY_TOKEN)")
    mode: str = _f("read_write", "read_write, save_only, load_only or off")
    namespace_extra: str = _f(
        "", "extra text folded into the namespace (e.g. weights revision) to keep caches apart"
    )
    model_id: str = _f("", "model identity for the namespace (default: vLLM's model name/path)")
    lookup_timeout_s: float = _f(
        0.05, "hard deadline of one lookup; on expiry the answer is 0 hits"
    )
    rpc_timeout_s: float = _f(5.0, "deadline of other control calls")
    transfer_timeout_s: float = _f(10.0, "deadline of one batched get or put")
    lookup_cache_s: float = _f(
        1.0, "a request asked again within this many seconds reuses its last lookup"
    )
    backoff_s: float = _f(1.0, "first pause after consecutive cluster failures (doubles)")
    backoff_max_s: float = _f(30.0, "longest pause of the failure backoff")
    failures_to_backoff: int = _f(3, "consecutive failures that open the circuit breaker")
    save_decode_blocks: bool = _f(
        False, "also save blocks filled by generated tokens (default: prompt blocks only)"
    )
    chunk_bytes: int = _f(
        8 << 20, "bytes per transfer chunk (a load keeps up to 3 in flight while copying)"
    )
    max_staging_bytes: int = _f(
        1 << 30, "host staging memory for transfers; saves beyond it are dropped, loads wait"
    )
    read_pin_s: float = _f(
        5.0,
        "after a hit, ask the nodes to keep the blocks from eviction this long (until the "
        "load); 0: no read pins",
    )
    same_host_shortcut: bool = _f(
        True,
        "copy blocks straight between the KV cache and local_node's pool file when that "
        "node runs on this host (no UCX hop); off: always UCX",
    )
    layerwise: bool = _f(
        True,
        "hits held wholly by local_node (same host) load during the forward pass, each "
        "layer waited for on its own; off: every load is asynchronous",
    )
    verify_threads: int = _f(
        0, "CPU threads that check checksums of same-host loads (0: min(16, cpus))"
    )
    idle_wait_s: float = _f(
        0.02, "in engine steps that only wait for loads, block this long for one to land"
    )
    known_blocks: int = _f(
        200_000, "hashes remembered as stored in the cluster (skips redundant saves)"
    )
    cost_model: bool = _f(
        True,
        "claim only hits whose load is expected to be faster than computing them (the "
        "whole hit, a leading part or nothing), from measured load and prefill costs; "
        "off: claim every hit",
    )
    report_interval_s: float = _f(
        10.0,
        "seconds between two 'PegaFlow cache:' lines in the engine log (lookups, hit rate, "
        "loads, saves, drops, failures), printed only when something happened; 0: never",
    )
    shutdown_wait_s: float = _f(
        10.0,
        "at engine shutdown, how long pending saves may take to finish; those still "
        "pending after it are dropped (counted, and logged as a warning)",
    )
    stats_path: str = _f(
        "", "write connector counters as JSON to <path>.<role><rank>.json (tests, debugging)"
    )
    log_level: str = _f(
        "",
        "level of the connector's log ('debug': one line per lookup and per layer-wise load, "
        "with timings); empty: as the engine sets it",
    )

    # ---- derived -------------------------------------------------------------------

    @property
    def can_load(self) -> bool:
        """Whether lookups and loads are enabled."""
        return self.mode in ("read_write", "load_only")

    @property
    def can_save(self) -> bool:
        """Whether saves are enabled."""
        return self.mode in ("read_write", "save_only")

    @classmethod
    def keys(cls) -> list[str]:
        """The accepted ``kv_connector_extra_config`` keys."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def load(
        cls, extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        """Build settings from vLLM's extra config and the environment.

        Unknown extra-config keys raise ``ValueError`` (a typo must not silently fall
        back to a default); so do malformed values and an unknown ``mode``.
        """
        env = os.environ if env is None else env
        extra = dict(extra or {})
        s = cls()
        hints = get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        # lowest precedence first
        shared = {
            "coordinators": env.get("PEGAFLOW_CLIENT_COORDINATORS"),
            "local_node": env.get("PEGAFLOW_CLIENT_LOCAL_NODE"),
            "host": env.get("PEGAFLOW_CLIENT_HOST"),
            "token": env.get("PEGAFLOW_SECURITY_TOKEN"),
            "lookup_timeout_s": env.get("PEGAFLOW_CLIENT_LOOKUP_TIMEOUT_S"),
            "rpc_timeout_s": env.get("PEGAFLOW_CLIENT_RPC_TIMEOUT_S"),
            "transfer_timeout_s": env.get("PEGAFLOW_CLIENT_TRANSFER_TIMEOUT_S"),
        }
        layers: list[tuple[str, dict[str, Any]]] = [
            ("env PEGAFLOW_CLIENT_*", {k: v for k, v in shared.items() if v is not None}),
            (
                "env PEGAFLOW_CONNECTOR_*",
                {
                    name: env[f"PEGAFLOW_CONNECTOR_{name.upper()}"]
                    for name in fields
                    if f"PEGAFLOW_CONNECTOR_{name.upper()}" in env
                },
            ),
        ]
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(
                f"unknown PegaKVConnector option(s) in kv_connector_extra_config: {unknown}; "
                f"known: {sorted(fields)}"
            )
        layers.append(("kv_connector_extra_config", extra))
        for where, values in layers:
            for name, value in values.items():
                setattr(s, name, _coerce(hints[name], value, f"{where}: {name}"))
        if s.mode not in _MODES:
            raise ValueError(f"PegaKVConnector mode must be one of {_MODES}, not {s.mode!r}")
        if not s.coordinators and s.mode != "off":
            raise ValueError("PegaKVConnector needs at least one coordinator address")
        for name in ("lookup_timeout_s", "rpc_timeout_s", "transfer_timeout_s"):
            if getattr(s, name) <= 0:
                raise ValueError(f"PegaKVConnector {name} must be > 0")
        for name in ("report_interval_s", "shutdown_wait_s"):
            if getattr(s, name) < 0:
                raise ValueError(f"PegaKVConnector {name} must be >= 0")
        if s.chunk_bytes <= 0 or s.max_staging_bytes <= 0:
            raise ValueError("PegaKVConnector chunk_bytes and max_staging_bytes must be > 0")
        return s

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict with the token hidden (for logs)."""
        d = dataclasses.asdict(self)
        if d.get("token"):
            d["token"] = "***"
        return d


def _coerce(typ: Any, value: Any, where: str) -> Any:
    try:
        if typ is bool:
            if isinstance(value, str):
                v = value.strip().lower()
                if v in ("1", "true", "yes", "on"):
                    return True
                if v in ("0", "false", "no", "off", ""):
                    return False
                raise ValueError(f"not a boolean: {value!r}")
            return bool(value)
        if typ is int:
            if isinstance(value, str):
                from pegaflow.config import parse_size

                return parse_size(value)
            if isinstance(value, bool) or int(value) != value:
                raise ValueError(f"not an integer: {value!r}")
            return int(value)
        if typ is float:
            return float(value)
        if typ is str:
            if not isinstance(value, str | int | float):
                raise ValueError(f"not a string: {value!r}")
            return str(value)
        if typ == list[str]:
            if isinstance(value, str):
                return [p.strip() for p in value.split(",") if p.strip()]
            if isinstance(value, list | tuple):
                return [str(p).strip() for p in value if str(p).strip()]
            raise ValueError(f"not a list: {value!r}")
    except (TypeError, ValueError) as e:
        raise ValueError(f"PegaKVConnector setting {where}: {e}") from None
    raise ValueError(f"PegaKVConnector setting {where}: unsupported type {typ}")
