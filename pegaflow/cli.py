"""``pegaflow``: the operator's command line.

    pegaflow status [--coordinators host:port,...] [--json]

prints the cluster as the coordinator sees it: nodes, capacity, usage, blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from pegaflow.config import load_config
from pegaflow.errors import PegaError
from pegaflow.rpc import RpcClient


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def render_status(st: dict[str, Any]) -> str:
    """The status document as a terminal table."""
    nodes = st.get("nodes", [])
    rows = [("NODE", "ADDRESS", "CAPACITY", "USED", "USE%", "BLOCKS", "UPTIME")]
    now = time.time()
    cap_total = used_total = 0
    for n in sorted(nodes, key=lambda n: n.get("node_id", "")):
        cap, used = int(n.get("capacity_bytes", 0)), int(n.get("used_bytes", 0))
        cap_total += cap
        used_total += used
        started = float(n.get("started_at") or 0)
        rows.append(
            (
                str(n.get("node_id")),
                f"{n.get('host')}:{n.get('ucx_port')}",
                _size(cap),
                _size(used),
                f"{100 * used / cap:.0f}%" if cap else "-",
                str(n.get("blocks", 0)),
                f"{(now - started) / 60:.0f} min" if started else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    coord = st.get("coordinator", {})
    lines.append("")
    lines.append(
        f"{len(nodes)} node(s), {_size(used_total)} of {_size(cap_total)} used, "
        f"{st.get('blocks', 0)} block entries in the index, {st.get('namespaces', 0)} namespace(s)"
    )
    hits, misses = coord.get("hit_blocks"), coord.get("miss_blocks")
    if isinstance(hits, int | float) and isinstance(misses, int | float) and hits + misses:
        total = hits + misses
        lines.append(f"lookup hit rate {100 * hits / total:.1f}% ({hits} of {total} blocks)")
    lines.append(
        f"coordinator {coord.get('id', '?')}: etcd "
        f"{'connected' if coord.get('etcd_connected') else 'not connected / not used'}, "
        f"up {coord.get('uptime_s', 0):.0f} s"
    )
    return "\n".join(lines)


async def _status(addresses: list[str], token: str | None, timeout: float) -> dict[str, Any]:
    client = RpcClient(addresses, token=token, timeout=timeout)
    try:
        return await client.call("status", {})
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pegaflow``."""
    parser = argparse.ArgumentParser(
        prog="pegaflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="TOML config file (also PEGAFLOW_CONFIG)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_status = sub.add_parser("status", help="show nodes, capacity, usage and blocks")
    p_status.add_argument(
        "--coordinators", help="comma-separated host:port (default: [client] coordinators)"
    )
    p_status.add_argument("--token", help="shared secret (default: [security] token)")
    p_status.add_argument("--timeout", type=float, default=5.0)
    p_status.add_argument("--json", action="store_true", help="print the raw status document")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    addresses = args.coordinators.split(",") if args.coordinators else cfg.client.coordinators
    token = args.token or cfg.security.token or None
    try:
        st = asyncio.run(_status(addresses, token, args.timeout))
    except PegaError as e:
        sys.exit(f"pegaflow: cannot get status from {', '.join(addresses)}: {e.code}: {e}")
    print(json.dumps(st, indent=2, default=str) if args.json else render_status(st))


if __name__ == "__main__":
    main()
