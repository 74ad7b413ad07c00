"""Which address each process binds and advertises (pegaflow.addresses): ``auto``
hosts, and the refusal of a loopback or wildcard node address with etcd elsewhere
(issue 35, defects 3 and 4)."""

from __future__ import annotations

import pytest

from pegaflow.addresses import (
    AUTO,
    LOOPBACK,
    advertised_problem,
    auto_host,
    client_host,
    remote,
    route_source,
    settle,
    settle_coordinator,
    settle_node,
    split_host,
)
from pegaflow.config import ClusterConfig, CoordinatorConfig, EtcdConfig, NodeConfig

# Only loopback addresses are routed here (a UDP connect is a routing lookup: nothing is
# sent), and no name is resolved: a failed lookup would ask a DNS server.


def test_split_host_reads_every_form() -> None:
    assert split_host("10.0.0.1:2379") == "10.0.0.1"
    assert split_host("http://etcd-0.etcd.pegaflow.svc:2379/") == "etcd-0.etcd.pegaflow.svc"
    assert split_host("[fd00::1]:7700") == "fd00::1"
    assert split_host("localhost") == "localhost"


def test_remote_counts_names_and_addresses_off_this_host() -> None:
    assert remote(["127.0.0.1:2379", "localhost:2379", "unix:/run/x.sock"]) == []
    assert remote(["[::1]:2379", "10.0.0.1:2379"]) == ["10.0.0.1:2379"]
    assert remote(["etcd.example:2379"]) == ["etcd.example:2379"]


def test_auto_is_loopback_on_one_host_and_the_route_source_otherwise() -> None:
    assert auto_host([], "etcd") == LOOPBACK
    assert auto_host(["127.0.0.1:2379"], "etcd") == LOOPBACK
    # 127.0.0.2 looks local to the form check (loopback range) and stays loopback
    assert auto_host(["127.0.0.2:2379"], "etcd") == LOOPBACK
    assert route_source("127.0.0.5:1") == "127.0.0.1"
    assert client_host(["127.0.0.1:7700"]) == LOOPBACK


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0", "::", ""])
def test_a_node_never_publishes_loopback_or_wildcard_to_a_remote_etcd(host: str) -> None:
    problem = advertised_problem(host, ["10.0.0.1:2379"])
    assert problem is not None and "--node-host" in problem and "another host" in problem
    with pytest.raises(ValueError, match="is on another host"):
        settle_node(NodeConfig(host=host), ["10.0.0.1:2379"])
    # on one host (etcd on loopback, or none) the same address is right
    assert advertised_problem(host, ["127.0.0.1:2379"]) is None
    assert advertised_problem(host, []) is None


def test_settled_hosts_and_http_hosts() -> None:
    node = settle_node(NodeConfig())
    assert node.host == LOOPBACK and node.http_host == LOOPBACK
    assert settle_node(node) == node  # idempotent
    given = settle_node(NodeConfig(host="10.0.0.2", http_host="0.0.0.0"), ["10.0.0.1:2379"])
    assert given.host == "10.0.0.2" and given.http_host == "0.0.0.0"
    coord = settle_coordinator(CoordinatorConfig())
    assert coord.host == LOOPBACK and coord.http_host == LOOPBACK
    assert ClusterConfig().node.host == AUTO == ClusterConfig().coordinator.host
    cfg = settle(ClusterConfig(etcd=EtcdConfig(endpoints=["127.0.0.1:2379"])), ["coordinator"])
    assert cfg.coordinator.host == LOOPBACK and cfg.node.host == AUTO  # only its sections
