"""Frozen config objects built once from layered sources of raw values.

A source is ``(where, {option: raw value})``; ``where`` names it in errors (a file, an
environment variable, a flag, vLLM's extra config).  :func:`build` converts every raw
value with :func:`~pegaflow.config.values.convert`, later sources winning, and builds
the frozen dataclass once.  :func:`load_config` layers a :class:`ClusterConfig`'s:
defaults < TOML file < ``PEGAFLOW_<TABLE>_<OPTION>`` < flags.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from .schema import SECTIONS, ClusterConfig
from .values import ConfigError, convert

T = TypeVar("T")

Source = tuple[str, Mapping[str, Any]]
"""``(where, {option: raw value})``: one layer of raw values and what names it in errors"""


def build(cls: type[T], sources: Iterable[Source], qualifier: str = "") -> T:
    """``cls`` (a dataclass) from its defaults and ``sources``, later ones winning.

    An unknown option or a bad value raises :class:`ConfigError` naming its source and
    ``<qualifier><option>`` (``qualifier``: e.g. ``"[node]."``)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for where, raw in sources:
        for key, value in raw.items():
            f = fields.get(key)
            if f is None:
                raise ConfigError(f"{where}: {qualifier.rstrip('.')}", f"unknown option {key!r}")
            try:
                values[key] = convert(f, hints[key], value)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{where}: {qualifier}{key}", str(e)) from None
    return cls(**values)


def env_sources(
    env: Mapping[str, str], table: str, names: Iterable[str], where: str = ""
) -> list[Source]:
    """One source per ``PEGAFLOW_<TABLE>_<NAME>`` set in ``env`` among ``names``
    (``where``: a prefix for its name in errors)."""
    out: list[Source] = []
    for name in names:
        var = f"PEGAFLOW_{table.upper()}_{name.upper()}"
        if var in env:
            out.append((f"{where}env {var}", {name: env[var]}))
    return out


def _read_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}", f"not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path}", str(e.strerror or e)) from None


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> ClusterConfig:
    """Build a :class:`ClusterConfig`: defaults < TOML file < environment < ``overrides``.

    ``defaults``: a program's own defaults over the schema's (``pegaflow-server`` sizes
    its pool by itself unless one is given).  Every problem (a file that cannot be read
    or parsed, an unknown option, a bad value) is a :class:`ConfigError` naming where it is."""
    env = os.environ if env is None else env
    path = path or env.get("PEGAFLOW_CONFIG") or None
    tables = _read_toml(path) if path else {}
    for name, values in tables.items():
        if name not in SECTIONS or not isinstance(values, dict):
            raise ConfigError(
                f"config {path}", f"unknown table [{name}] (tables: {', '.join(SECTIONS)})"
            )
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        names = [f.name for f in dataclasses.fields(cls)]
        sources: list[Source] = [
            ("config defaults", (defaults or {}).get(name, {})),
            (f"config {path}", tables.get(name, {})),
            *env_sources(env, name, names, "config "),
            ("config flag", (overrides or {}).get(name, {})),
        ]
        sections[name] = build(cls, sources, f"[{name}].")
    return ClusterConfig(**sections)
