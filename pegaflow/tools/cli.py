"""``pegaflow``: the operator's command line.

    pegaflow [--config FILE] status [--coordinators HOST:PORT,...] [--json] [--no-health]
                                    [--router URL]

prints the cluster as the coordinator sees it: every node with its health, capacity,
usage and blocks, then the totals, the lookup hit rate and the coordinator's state.
The hit rate is the cluster's: the lookups this coordinator answered and those that the
connectors' same-host nodes answered alone (reported by the connectors to their node);
engine-start warm-ups are not counted.

A node's health is what its own HTTP ``/health`` answers (asked directly, at the
address the node published): ``ok``, ``unhealthy`` (it answered 503), ``unreachable``
(no answer: a firewall, or the node is going down; it is still in the index while its
lease lives), ``wrong-node:<id>`` (node ``<id>`` answers at the address this node
published: two nodes publish one address, e.g. a loopback or wildcard ``--node-host``)
or ``-`` (no HTTP endpoint published).  ``--no-health`` skips asking.
Then every ``pegaflow-router`` that reports to this coordinator (``[router]
report_interval_s``): its mode, and each replica with its health and in-flight load.
``--router URL`` asks one router directly instead (it need not report anywhere).
Exit status: 0 when the coordinator answered and every node is ``ok`` or ``-``, 1 when
some node is not, or a router shown has a replica out of rotation
(or, with ``--router``, cannot be reached), 2 when no coordinator answered or the command
line or configuration is wrong (one line on stderr says why).

    pegaflow [--config FILE] drop --node ID --namespace NS [--coordinators ...] [--token-file FILE]

drops every block of namespace ``NS`` from node ``ID`` (the cluster token is needed):
they leave the index and the node's pool, blocks being read once their reads end.
Exit status 0 when the node did it, 2 when it could not be asked or refused.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import ssl
import sys
import time
from typing import Any

from pegaflow.auth import cluster_token
from pegaflow.config import ArgParser, load_config, parse_addresses, refuse_secret
from pegaflow.errors import PegaError
from pegaflow.keys import node_http_url
from pegaflow.protocol.coordinator import Op
from pegaflow.protocol.misses import shares
from pegaflow.tls import client_context, http_scheme
from pegaflow.transport.rpc_client import RpcClient

_Credentials = tuple[str | None, ssl.SSLContext | None]
"""the cluster token and the TLS context of the commands' calls"""

HEALTH_TIMEOUT_S = 2.0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _bar(frac: float, width: int = 10) -> str:
    full = round(max(0.0, min(1.0, frac)) * width)
    return "#" * full + "." * (width - full)


def _hit_rate_line(st: dict[str, Any]) -> str | None:
    """The lookup hit rate line: the cluster's lookups (this coordinator's and those the
    nodes answered alone for their host's connectors), or, from a coordinator that
    predates ``cluster_lookups``, its own."""
    cluster = st.get("cluster_lookups")
    if isinstance(cluster, dict):
        src, scope = cluster, "this coordinator and the nodes since they started"
    else:
        src, scope = st.get("coordinator", {}), "this coordinator since start"
    hits, misses, lookups = src.get("hit_blocks"), src.get("miss_blocks"), src.get("lookups")
    if not (isinstance(hits, int | float) and isinstance(misses, int | float)):
        return None
    if not hits + misses:
        return "lookup hit rate: no lookups yet"
    total = hits + misses
    same = src.get("same_host_lookups") or 0
    same_text = f", {same} lookup(s) answered by a same-host node" if same else ""
    return (
        f"lookup hit rate {100 * hits / total:.1f}% ({hits} of {total} blocks"
        f"{f' in {lookups} lookups' if lookups else ''}{same_text}; {scope})"
    )


def _misses_line(st: dict[str, Any]) -> str | None:
    """Why lookups missed, as this coordinator answered them: the missed blocks' share by
    the cause of each lookup's first miss (:mod:`pegaflow.coordinator.evictions`), and
    the removals it saw by tier (None: a coordinator that predates them)."""
    m = st.get("misses")
    if not isinstance(m, dict):
        return None
    causes = shares(m.get("miss_blocks_by_cause") or {})
    removals = m.get("removals") or {}
    gone = ", ".join(f"{removals.get(t, 0)} from {t}" for t in ("memory", "disk"))
    return f"misses: {causes or 'none yet'} (this coordinator since start); evictions: {gone}"


def _engine_misses_line(st: dict[str, Any]) -> str | None:
    """Why lookups missed, as the engines reporting to this coordinator count them
    (:mod:`pegaflow.coordinator.enginemisses`): the causes only an engine knows (declined
    by its cost model, a failed lookup, its save dropped or refused by a quota) included
    (None: a coordinator that predates the reports)."""
    m = st.get("misses")
    if not isinstance(m, dict) or "engines" not in m:
        return None
    n = len(m.get("engines") or [])
    causes = shares(m.get("engine_miss_blocks_by_cause") or {}, m.get("engine_miss_details"))
    return f"engines' misses: {causes or 'none yet'} ({n} engine{'' if n == 1 else 's'} reporting)"


def _disk_cell(n: dict[str, Any]) -> str:
    """A node's disk tier in ``pegaflow status``: bytes used of its capacity."""
    cap = int(n.get("disk_capacity_bytes") or 0)
    if not cap:
        return "-"
    return f"{_size(int(n.get('disk_used_bytes') or 0))}/{_size(cap)}"


def render_status(st: dict[str, Any], health: dict[str, str] | None = None) -> str:
    """The status document as a terminal table; ``health`` maps node ids to their
    health (a HEALTH column is shown when it is given)."""
    nodes = st.get("nodes", [])
    head = ["NODE", "ADDRESS", "HEALTH", "CAPACITY", "USED", "USE", "BLOCKS", "ENTRIES", "UP"]
    if health is None:
        head.remove("HEALTH")
    disk = any(int(n.get("disk_capacity_bytes") or 0) for n in nodes)
    if disk:  # the disk tier: used of capacity
        head.insert(head.index("BLOCKS") + 1, "DISK")
    rows = [tuple(head)]
    now = time.time()
    cap_total = used_total = 0
    for n in sorted(nodes, key=lambda n: str(n.get("node_id", ""))):
        cap, used = int(n.get("capacity_bytes", 0)), int(n.get("used_bytes", 0))
        cap_total += cap
        used_total += used
        started = float(n.get("started_at") or 0)
        row = [
            str(n.get("node_id")),
            f"{n.get('host')}:{n.get('ucx_port')}",
            health.get(str(n.get("node_id")), "-") if health is not None else "",
            _size(cap),
            _size(used),
            f"{_bar(used / cap)} {100 * used / cap:3.0f}%" if cap else "-",
            str(n.get("blocks", 0)),
            *([_disk_cell(n)] if disk else []),
            str(n.get("entries", "-")),
            _duration(now - started) if started else "-",
        ]
        if health is None:
            del row[2]
        rows.append(tuple(row))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if not nodes:
        lines.append("(no storage node is registered)")
    coord = st.get("coordinator", {})
    lines.append("")
    pct = f" ({100 * used_total / cap_total:.0f}%)" if cap_total else ""
    lines.append(
        f"{len(nodes)} node(s), {_size(used_total)} of {_size(cap_total)} used{pct}, "
        f"{st.get('blocks', 0)} blocks in the index, {st.get('namespaces', 0)} namespace(s)"
    )
    if health is not None and nodes:
        bad = sorted(k for k, v in health.items() if not health_ok(v))
        lines.append("health: all nodes ok" if not bad else f"health: NOT ok: {', '.join(bad)}")
        wrong = [(k, v.split(":", 1)[1]) for k, v in health.items() if v.startswith(WRONG_NODE)]
        for k, other in sorted(wrong):
            lines.append(
                f"  node {k}: node {other} answers at the HTTP address it published: two "
                "nodes publish one address (e.g. a loopback or wildcard --node-host); give "
                "each node its host's address"
            )
    rate = _hit_rate_line(st)
    if rate is not None:
        lines.append(rate)
    for line in (_misses_line(st), _engine_misses_line(st)):
        if line is not None:
            lines.append(line)
    etcd = (
        "not used (single host)"
        if coord.get("mode") == "local"
        else ("connected" if coord.get("etcd_connected") else "NOT CONNECTED")
    )
    extra = ""
    if coord.get("mode") != "local" and isinstance(coord.get("etcd"), dict):
        lag = coord["etcd"].get("lag_revisions")
        if lag:
            extra = f", {lag} revision(s) behind"
    http = f", dashboard on http port {coord['http_port']}" if coord.get("http_port") else ""
    lines.append(
        f"coordinator {coord.get('id', '?')}: etcd {etcd}{extra}, "
        f"up {_duration(float(coord.get('uptime_s', 0)))}{http}"
    )
    election = coord.get("election")
    if isinstance(election, dict):
        if coord.get("leader"):
            gc = coord.get("gc") if isinstance(coord.get("gc"), dict) else {}
            lines.append(
                f"elected leader (index GC): this coordinator; GC deleted "
                f"{gc.get('deleted', 0)} stale entries in {gc.get('passes', 0)} passes"
            )
        else:
            lines.append(f"elected leader (index GC): {election.get('leader_id') or 'none yet'}")
    return "\n".join(lines)


WRONG_NODE = "wrong-node:"
"""the health of a node whose published HTTP address another node answers at (the
other's id follows)"""


def health_ok(h: str) -> bool:
    """Whether a node's health (of :func:`node_health`) counts as ok for the exit status
    (``ok``, or ``-``: not asked)."""
    return h in ("ok", "-")


def answering_node(body: Any) -> str:
    """The node id a ``/health`` body names ('' when none: an older node)."""
    if isinstance(body, dict) and isinstance(body.get("node_id"), str):
        return body["node_id"]
    return ""


async def node_health(
    nodes: list[dict[str, Any]],
    timeout: float = HEALTH_TIMEOUT_S,
    tls: ssl.SSLContext | None = None,
) -> dict[str, str]:
    """Ask every node's ``/health`` (concurrently; over HTTPS verified by ``tls`` if
    given); ``{node_id: health}``.  A node whose ``/health`` names another node id is
    ``wrong-node:<that id>`` whatever its status."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, rec: dict[str, Any]) -> tuple[str, str]:
        nid = str(rec.get("node_id"))
        base = node_http_url(rec, http_scheme(tls))
        if base is None:
            return nid, "-"
        url = base + "/health"
        try:
            async with session.get(url, ssl=tls or True) as r:
                try:
                    other = answering_node(await r.json(content_type=None))
                except ValueError:
                    other = ""
                if other and other != nid:
                    return nid, WRONG_NODE + other
                return nid, "ok" if r.status == 200 else "unhealthy"
        except (TimeoutError, aiohttp.ClientError, OSError):
            return nid, "unreachable"

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        return dict(await asyncio.gather(*(one(session, n) for n in nodes)))


async def _status(
    addresses: list[str], cred: _Credentials, timeout: float, health: bool
) -> tuple[dict[str, Any], dict[str, str] | None]:
    token, tls = cred
    client = RpcClient(addresses, token=token, timeout=timeout, tls=tls)
    try:
        st = await client.call(Op.STATUS, {})
    finally:
        await client.close()
    if not health:
        return st, None
    return st, await node_health(st.get("nodes", []), min(timeout, HEALTH_TIMEOUT_S), tls)


def _drop(addresses: list[str], cred: _Credentials, timeout: float, node: str, ns: str) -> int:
    """``pegaflow drop``: its exit status."""
    from pegaflow.client import PegaClient
    from pegaflow.config import ClientConfig

    async def run() -> str:
        cfg = ClientConfig(coordinators=addresses, rpc_timeout_s=timeout)
        client = PegaClient(cfg, cred[0], tls=cred[1])
        try:
            out = await client.drop(node, ns)
        finally:
            await client.close()
        return f"node {node}: dropped {out.dropped} blocks of {ns!r}" + (
            f"; {out.pinned} being read are dropped once their reads end" if out.pinned else ""
        )

    try:
        print(asyncio.run(run()))
    except PegaError as e:
        print(f"pegaflow: cannot drop {ns!r} from node {node}: {e.code}: {e}", file=sys.stderr)
        return 2
    return 0


def _seconds(value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        t = -1.0
    if not t > 0:
        raise argparse.ArgumentTypeError(f"not a number of seconds > 0: {value!r}")
    return t


def _addresses(value: str) -> list[str]:
    try:
        return parse_addresses(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_cluster_args(
    p: argparse.ArgumentParser, config_help: str, *, coordinators: str, token: str, timeout: str
) -> None:
    """A command's ``--config``, ``--coordinators``, ``--token-file`` and ``--timeout``
    (with these helps for the last three); ``--token`` is refused (a secret in ``ps``)."""
    # SUPPRESS: a --config given before the command is not reset by this one's default
    p.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help=config_help)
    p.add_argument("--coordinators", type=_addresses, metavar="HOST:PORT[,...]", help=coordinators)
    p.add_argument("--token-file", metavar="FILE", help=token)
    refuse = refuse_secret("--token-file", "PEGAFLOW_SECURITY_TOKEN")
    p.add_argument("--token", type=refuse, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=_seconds, default=5.0, metavar="SECONDS", help=timeout)


def _emit(text: str) -> None:
    """Print ``text``; a reader that went away (``pegaflow status | head -3``) ends the
    output quietly, and the exit status stays the status's."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # the interpreter's flush of stdout at exit would fail again: point it nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pegaflow``: every error is one line on stderr and exit status 2."""
    parser = ArgParser(
        prog="pegaflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    config_help = "TOML config file (also PEGAFLOW_CONFIG); before or after the command"
    parser.add_argument("--config", metavar="FILE", help=config_help)
    sub = parser.add_subparsers(dest="cmd")
    p_status = sub.add_parser(
        "status", help="show nodes, health, capacity, usage, blocks and the hit rate"
    )
    _add_cluster_args(
        p_status,
        config_help,
        coordinators="coordinators to ask, tried in order (default: [client] coordinators, "
        "127.0.0.1:7700)",
        token="file holding the shared secret (default: [security] token_file or token)",
        timeout="deadline of the status call (default: 5.0)",
    )
    p_status.add_argument("--json", action="store_true", help="print the raw status document")
    p_status.add_argument("--no-health", action="store_true", help="do not ask each node's /health")
    router_help = (
        "also ask this pegaflow-router for its replicas and their load (the routers that "
        "report to the coordinator are shown without it)"
    )
    p_status.add_argument("--router", metavar="URL", help=router_help)
    p_drop = sub.add_parser("drop", help="drop one namespace's blocks from a node")
    p_drop.add_argument("--node", required=True, metavar="ID", help="the node's id")
    p_drop.add_argument("--namespace", required=True, metavar="NS", help="the namespace")
    _add_cluster_args(
        p_drop,
        config_help,
        coordinators="coordinators that know the node (default: [client] coordinators)",
        token="file holding the cluster token (default: [security] token_file or token)",
        timeout="deadline of the drop (default: 5.0)",
    )
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.error("a command is required: status, drop")
    try:
        cfg = load_config(args.config)
    except ValueError as e:
        parser.exit(2, f"pegaflow: error: {e}\n")
    addresses = args.coordinators or cfg.client.coordinators
    sec = cfg.security
    if args.token_file:
        sec = dataclasses.replace(sec, token="", token_file=args.token_file)
    try:
        cred = (cluster_token(sec), client_context(sec))
    except ValueError as e:
        parser.exit(2, f"pegaflow: error: {e}\n")
    if args.cmd == "drop":
        sys.exit(_drop(addresses, cred, args.timeout, args.node, args.namespace))
    try:
        st, health = asyncio.run(_status(addresses, cred, args.timeout, not args.no_health))
    except PegaError as e:
        print(
            f"pegaflow: cannot get status from {', '.join(addresses)}: {e.code}: {e}",
            file=sys.stderr,
        )
        sys.exit(2)
    from pegaflow.router.status import fetch_router_status, render_router, router_healthy

    router: dict[str, Any] | None = None
    if args.router:
        router = asyncio.run(fetch_router_status(args.router, args.timeout, cred[1]))
    reported = [r for r in st.get("routers") or [] if isinstance(r, dict)]
    shown = [r for r in reported if router is None or r.get("url") != router["url"]]
    if router is not None:
        shown.append(router)
    if args.json:
        if health is not None:
            st = {**st, "health": health}
        if router is not None:
            st = {**st, "router": router}
        _emit(json.dumps(st, indent=2, default=str))
    else:
        _emit("\n".join([render_status(st, health), *(render_router(r) for r in shown)]))
    if health and not all(health_ok(v) for v in health.values()):
        sys.exit(1)
    if not all(router_healthy(r) for r in shown):
        sys.exit(1)


if __name__ == "__main__":
    main()
