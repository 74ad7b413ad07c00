"""The routers a coordinator knows of: what each ``pegaflow-router`` last reported.

A router given coordinators (``[client] coordinators``) sends each of them a
``router_report`` every ``[router] report_interval_s`` seconds: its URL, mode, replicas
with their health and load, and how long the report holds (``ttl_ms``).  The coordinator
keeps the last report of each router, by URL, in memory (not in etcd: it is a status
display, rebuilt within one interval after a coordinator restarts) and drops it when its
TTL passes; a report with ``ttl_ms: 0`` (a router stopping) drops it at once.

``router_report``: see :mod:`pegaflow.protocol.coordinator` (its fields, their bounds);
the reply says how many routers this coordinator now lists.

Who may report (with ``[security] tenant_tokens``): an entry belongs to the connection
that made it, a tenant or the cluster (the cluster token, or a coordinator without
tokens).  A tenant's connection may list a URL nobody lists, and replace or withdraw
its own entries only, ``MAX_ROUTERS_PER_TENANT`` at most; a report for another's entry
is refused (``Unauthorized``).  The cluster token may replace or withdraw any entry
(which is then the cluster's).  The status document names each entry's ``tenant``
(``""``: the cluster's).
"""

from __future__ import annotations

import time
from typing import Any

from pegaflow.errors import TooLarge, Unauthorized
from pegaflow.protocol.coordinator import parse_report
from pegaflow.transport.rpc_server import current_tenant

#: Most routers one coordinator lists; a report from one more is refused.
MAX_ROUTERS = 256
#: Most routers one tenant lists on one coordinator (a tenant cannot crowd others out).
MAX_ROUTERS_PER_TENANT = 16


class RouterTable:
    """The last report of each router, until its TTL passes."""

    def __init__(
        self, max_routers: int = MAX_ROUTERS, max_per_tenant: int = MAX_ROUTERS_PER_TENANT
    ) -> None:
        self.max_routers = max_routers
        self.max_per_tenant = max_per_tenant
        self._routers: dict[str, tuple[float, float, str | None, dict[str, Any]]] = {}
        """url -> (monotonic expiry, wall-clock time of the report, its tenant, the record)"""

    def _expire(self, now: float) -> None:
        for url in [u for u, (exp, *_) in self._routers.items() if exp <= now]:
            del self._routers[url]

    def op_report(self, args: dict[str, Any]) -> dict[str, Any]:
        """The ``router_report`` op (see the module docstring), for the tenant of the
        connection that sent it."""
        return self.report(args, current_tenant())

    def report(self, args: dict[str, Any], tenant: str | None) -> dict[str, Any]:
        """Take a report from ``tenant`` (None: the cluster); ``Unauthorized`` for
        another's entry, ``TooLarge`` past a bound."""
        rec = parse_report(args)
        now = time.monotonic()
        self._expire(now)
        url = rec["url"]
        held = self._routers.get(url)
        if tenant is not None and held is not None and held[2] != tenant:
            raise Unauthorized(
                f"router {url} is listed by another tenant or the cluster: a tenant's "
                "connection may report and withdraw its own routers only (is another "
                "router reporting this URL?)"
            )
        if not rec["ttl_ms"]:
            self._routers.pop(url, None)
            return {"routers": len(self._routers)}
        if held is None:
            if len(self._routers) >= self.max_routers:
                raise TooLarge(
                    f"this coordinator lists {self.max_routers} routers already; a new one "
                    "is listed once another stops reporting"
                )
            if tenant is not None:
                mine = sum(1 for _, _, t, _ in self._routers.values() if t == tenant)
                if mine >= self.max_per_tenant:
                    raise TooLarge(
                        f"tenant {tenant!r} lists {mine} routers on this coordinator, the "
                        "most one tenant may; a new one is listed once another stops"
                    )
        self._routers[url] = (now + rec["ttl_ms"] / 1000, time.time(), tenant, rec)
        return {"routers": len(self._routers)}

    def status(self) -> list[dict[str, Any]]:
        """The status document's ``routers``: each live router's last report, with
        ``tenant`` (``""``: the cluster's), ``last_seen`` (wall-clock time) and
        ``last_seen_s`` (seconds ago), by URL."""
        now = time.monotonic()
        self._expire(now)
        wall = time.time()
        out = []
        for url in sorted(self._routers):
            _, seen, tenant, rec = self._routers[url]
            out.append(
                {
                    **rec,
                    "tenant": tenant or "",
                    "last_seen": round(seen, 3),
                    "last_seen_s": round(wall - seen, 3),
                }
            )
        return out
