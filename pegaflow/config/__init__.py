"""Configuration of every component: one frozen dataclass each, built once from layered
sources by one loader with one converter.

Layers, last wins: defaults < TOML file (``--config`` or ``PEGAFLOW_CONFIG``) <
``PEGAFLOW_<TABLE>_<OPTION>`` < command-line ``--<table>-<option>``.  The vLLM connector's
settings (:mod:`pegaflow.connector.settings`) are built by the same loader from its
own sources.  ``python -m pegaflow.config`` prints the reference (docs/configuration.md).

- :mod:`.values`: raw value -> typed value (sizes, booleans, addresses), :class:`ConfigError`;
- :mod:`.schema`: the dataclasses;
- :mod:`.loader`: :func:`build` from sources, :func:`load_config`;
- :mod:`.flags`: argparse flags and the generated reference.
"""

from .flags import (
    ArgParser,
    add_arguments,
    config_from_args,
    flag_name,
    reference_markdown,
    refuse_secret,
)
from .loader import Source, build, env_sources, load_config
from .schema import (
    SECTIONS,
    ClientConfig,
    ClusterConfig,
    CoordinatorConfig,
    EtcdConfig,
    NodeConfig,
    RouterConfig,
    SecurityConfig,
    TelemetryConfig,
)
from .values import (
    SIZE_RULE,
    ConfigError,
    check_address,
    convert,
    format_size,
    opt,
    parse_addresses,
    parse_bool,
    parse_size,
    same_option,
)

__all__ = [
    "SECTIONS",
    "SIZE_RULE",
    "ArgParser",
    "ClientConfig",
    "ClusterConfig",
    "ConfigError",
    "CoordinatorConfig",
    "EtcdConfig",
    "NodeConfig",
    "RouterConfig",
    "SecurityConfig",
    "Source",
    "TelemetryConfig",
    "add_arguments",
    "build",
    "check_address",
    "config_from_args",
    "convert",
    "env_sources",
    "flag_name",
    "format_size",
    "load_config",
    "opt",
    "parse_addresses",
    "parse_bool",
    "parse_size",
    "reference_markdown",
    "refuse_secret",
    "same_option",
]
