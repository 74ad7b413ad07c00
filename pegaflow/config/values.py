"""Raw configuration values into typed ones: the one converter every source goes through.

A value may come from TOML, an environment variable, a command-line flag or vLLM's
``kv_connector_extra_config``; whichever it is, :func:`convert` turns it into its
field's type or raises ``ValueError`` saying what a good one looks like, and
:class:`ConfigError` names the source and the option.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import field
from fractions import Fraction
from typing import Any

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


class ConfigError(ValueError):
    """A bad option or value: ``<where>: <problem>``, ``where`` naming the source (file,
    environment variable, flag, extra config) and the option."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


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


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it exactly (``64MiB``)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


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


def _items(v: Any) -> list[Any]:
    """A comma-separated string or a list as its items, stripped, empty ones left out."""
    if isinstance(v, str):
        return [s.strip() for s in v.split(",") if s.strip()]
    if isinstance(v, list | tuple):
        return [s.strip() if isinstance(s, str) else s for s in v if s != "" and s is not None]
    raise ValueError(f"not a list: {v!r}")


def parse_addresses(v: str | list[str] | tuple[str, ...]) -> list[str]:
    """A comma-separated string or a list of addresses, each checked by
    :func:`check_address`."""
    try:
        items = _items(v)
    except ValueError:
        raise ValueError(f"not a list of addresses: {v!r}") from None
    return [check_address(s) for s in items]


def opt(
    default: Any,
    help: str,
    *,
    size: bool = False,
    addresses: bool = False,
    metavar: str = "",
    secret: bool = False,
) -> Any:
    """A documented config field (``size=True``: accepts ``"8GiB"`` style values;
    ``addresses=True``: a list of ``host:port``; ``metavar``: its name in ``--help``;
    ``secret=True``: refused as a command-line flag, where ``ps`` shows it: its
    ``<name>_file`` sibling is the flag)."""
    meta = {
        "help": help, "size": size, "addresses": addresses, "metavar": metavar, "secret": secret
    }  # fmt: skip
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
    return field(default=default, metadata=meta)


def same_option(cls: type, name: str, help: str = "") -> Any:
    """Option ``name`` of the dataclass ``cls`` declared again in another one: the same
    default and kind (``help``: a text of its own there)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    meta = {**f.metadata, "help": help or f.metadata["help"]}
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory, metadata=meta)
    return field(default=f.default, metadata=meta)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"not an integer: {value!r}")
    try:
        n = int(value.strip()) if isinstance(value, str) else int(value)
    except ValueError:
        raise ValueError(f"not an integer: {value!r}") from None
    if n != value and not isinstance(value, str):
        raise ValueError(f"not an integer: {value!r}")
    lo, hi = _PORT_RANGE
    if name.endswith("port") and not lo <= n <= hi:
        raise ValueError(f"not a port: {value!r} (0-65535, or -1 where it means off)")
    return n


def convert(f: dataclasses.Field[Any], typ: Any, value: Any) -> Any:
    """``value`` (from any source) as field ``f``'s type ``typ``; a value that is not
    one (``maybe`` for a bool, ``1.5`` for an int) raises ``ValueError``."""
    if f.metadata.get("size"):
        return parse_size(value)
    if typ is bool:
        return parse_bool(value)
    if typ is int:
        return _integer(f.name, value)
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
        return [str(s) for s in _items(value)]
    raise ValueError(f"unsupported type {typ}")
