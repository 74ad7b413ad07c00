"""The routers' part of ``pegaflow status``: each router's replicas and their load, from
the coordinator's status document (the routers that report to it) or, with
``--router URL``, from the router's own ``/v1/status``."""

from __future__ import annotations

import ssl
from typing import Any


async def fetch_router_status(
    url: str, timeout: float, tls: ssl.SSLContext | None = None
) -> dict[str, Any]:
    """``GET <url>/v1/status`` of a router within ``timeout`` seconds (an ``https://``
    URL verified by ``tls``); on failure a document ``{"url": url, "error": why}``."""
    import aiohttp

    base = url.rstrip("/")
    if "://" not in base:
        base = "http://" + base
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
            s.get(base + "/v1/status", ssl=tls or True) as r,
        ):
            if r.status != 200:
                return {"url": base, "error": f"/v1/status answered {r.status}"}
            doc = await r.json()
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        return {"url": base, "error": f"unreachable ({type(e).__name__}: {e})"}
    if not isinstance(doc, dict) or not isinstance(doc.get("replicas"), list):
        return {"url": base, "error": "not a pegaflow-router /v1/status document"}
    return {"url": base, **doc}


def router_healthy(doc: dict[str, Any]) -> bool:
    """Whether the router answered and every replica of it is in rotation."""
    return "error" not in doc and all(r.get("healthy") for r in doc.get("replicas", []))


def render_router(doc: dict[str, Any]) -> str:
    """A router's status as terminal lines: its ``/v1/status`` document as
    :func:`fetch_router_status` returns it, or an entry of the coordinator's ``routers``
    (the same fields, flat, with ``last_seen_s``)."""
    if "error" in doc:
        return f"router {doc['url']}: {doc['error']}"
    info = doc.get("router") if isinstance(doc.get("router"), dict) else doc
    reps = doc.get("replicas", [])
    up = sum(1 for r in reps if r.get("healthy"))
    seen = doc.get("last_seen_s")
    seen_text = f", reported {seen:.0f} s ago" if isinstance(seen, int | float) else ""
    tenant = doc.get("tenant")
    tenant_text = f", tenant {tenant}" if tenant else ""
    lines = [
        f"router {doc['url']}: mode {info.get('mode', '?')}, {up} of {len(reps)} replicas "
        f"healthy, affinity cap {info.get('max_inflight', '?')} in flight{seen_text}"
        f"{tenant_text}"
    ]
    lines.append(
        f"  {'replica':<32} {'role':<8} {'node/host':<20} {'health':<9} "
        f"{'inflight':>8} {'queued':>7} {'requests':>9} {'failures':>8}"
    )
    for r in reps:
        where = r.get("node") or r.get("host") or "-"
        health = "ok" if r.get("healthy") else "DOWN"
        lines.append(
            f"  {r.get('url', '?'):<32} {r.get('role', '?'):<8} {where:<20} {health:<9} "
            f"{r.get('inflight', 0):>8} {r.get('queued_blocks', 0):>7.0f} "
            f"{r.get('requests', 0):>9} {r.get('failures', 0):>8}"
        )
        if not r.get("healthy") and r.get("last_error"):
            lines.append(f"    last error: {r['last_error']}")
        view = r.get("gpu_view")
        if isinstance(view, dict):
            lines.append(
                f"    GPU cache from KV events: {view.get('blocks', 0)} blocks, "
                f"{'in use' if view.get('usable') else 'NOT USED (stale or resyncing)'}, "
                f"hashes {view.get('hash_check', '?')}, {view.get('resyncs', 0)} resyncs, "
                f"{view.get('restarts', 0)} restarts"
            )
    counters = doc.get("counters") or {}
    if counters:
        lines.append("  routes: " + ", ".join(f"{k} {v}" for k, v in counters.items()))
    return "\n".join(lines)
