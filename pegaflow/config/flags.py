"""The command line of the config schema: one flag per option, and its reference doc."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any, NoReturn, get_type_hints

from .loader import load_config
from .schema import SECTIONS, ClusterConfig
from .values import SIZE_RULE, convert, format_size


class ArgParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2, with
    ``--version`` (prints ``<prog> <version>``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.description:  # a module docstring: its RST ``literals`` read as `literals`
            self.description = self.description.replace("``", "`")
        from pegaflow import __version__

        self.add_argument(
            "--version", action="version", version=f"%(prog)s {__version__}",
            help="print the program's name and version, and exit",
        )  # fmt: skip

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message>`` and exit with status 2 (no usage dump)."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


_METAVARS = {
    "node_id": "NAME",
    "username": "NAME",
    "service_name": "NAME",
    "password": "SECRET",
    "prefix": "PREFIX",
    "otlp_endpoint": "URL",
    "otlp_protocol": "PROTOCOL",
    "ucx_net_devices": "DEVICES",
    "disk_path": "DIR",
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
    if f.name.endswith("_per_s") and typ in (int, float):
        return "N"  # a rate: its help says per what
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
    if "cert" in f.name or f.name.endswith(("_key", "_path", "_file", "_ca")):
        return "FILE"
    return "TEXT"


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
        cls = SECTIONS[name]
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            typ = hints[f.name]

            def parse(value: str, f: dataclasses.Field[Any] = f, typ: Any = typ) -> Any:
                try:
                    return convert(f, typ, value)
                except (TypeError, ValueError) as e:
                    raise argparse.ArgumentTypeError(str(e)) from None

            if f.metadata.get("secret"):
                _refuse_secret(group, name, f.name)
                continue
            default = (defaults or {}).get(name, {}).get(f.name, _field_default(f))
            help_text = f"{f.metadata['help']} (default: {_show(f, typ, default)})"
            kw: dict[str, Any] = {
                "dest": f"{name}__{f.name}",
                "default": None,
                "type": parse,
                "metavar": _metavar(f, typ),
            }
            if typ is bool:  # a bare --node-keep-pool means true
                kw.update(nargs="?", const=True)
            flag = flag_name(name, f.name)
            group.add_argument(flag, help=help_text.replace("%", "%%"), **kw)
            long = f"--{name}-{f.name}".replace("_", "-")
            if long != flag:  # the old spelling, kept working, not shown
                group.add_argument(long, help=argparse.SUPPRESS, **kw)


def refuse_secret(file_flag: str, env: str) -> Callable[[str], NoReturn]:
    """An argparse ``type`` that refuses a secret given as a flag (other users see it in
    ``ps``), pointing to ``file_flag`` and the environment variable ``env`` instead."""

    def refuse(_value: str) -> NoReturn:
        raise argparse.ArgumentTypeError(
            f"a secret is not taken on the command line (other users see it in ps): use "
            f"{file_flag} FILE, the environment ({env}) or the config file"
        )

    return refuse


def _refuse_secret(group: Any, section: str, name: str) -> None:
    """Make ``--<section>-<name>`` (a secret) an error pointing to its file option."""
    flag = flag_name(section, name)
    refuse = refuse_secret(f"{flag}-file", f"PEGAFLOW_{section.upper()}_{name.upper()}")
    group.add_argument(flag, dest=f"{section}__{name}", type=refuse, help=argparse.SUPPRESS)


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
        "Generated by `python -m pegaflow.config` from `pegaflow/config/schema.py`; do not edit.",
        "",
        "Precedence: defaults < TOML file (`--config` or `PEGAFLOW_CONFIG`) <",
        "environment `PEGAFLOW_<TABLE>_<OPTION>` < command-line `--<table>-<option>`.",
        "Flags: `--<table>-<option>`, the table not repeated (`[node] node_id` is `--node-id`).",
        "Booleans: `true`/`false`, `yes`/`no`, `on`/`off`, `1`/`0`; anything else is an error.",
        f"Sizes: {SIZE_RULE}.",
        "Lists accept comma-separated strings.",
        "",
    ]
    for name, cls in SECTIONS.items():
        out += [f"## `[{name}]`", "", (cls.__doc__ or "").strip(), ""]
        out += ["| option | default | flag | env | meaning |", "|---|---|---|---|---|"]
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = _show(f, hints[f.name], _field_default(f))
            env = f"PEGAFLOW_{name.upper()}_{f.name.upper()}"
            flag = f"{flag_name(name, f.name)} {_metavar(f, hints[f.name])}"
            if f.metadata.get("secret"):
                flag = f"(none: {flag_name(name, f.name)}-file FILE)"
            out.append(f"| `{f.name}` | `{default}` | `{flag}` | `{env}` | {f.metadata['help']} |")
        out.append("")
    return "\n".join(out)

