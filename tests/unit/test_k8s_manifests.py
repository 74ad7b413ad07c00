"""The Kubernetes manifests in configs/k8s: valid resources (kubernetes-validate, strict,
offline schemas), their embedded configs load, every PEGAFLOW_* variable they set is a
real option, the vLLM Deployment fits the node DaemonSet it relies on, the node binds
and advertises its host's address, and the etcd example serves the endpoints the
ConfigMaps name with the settings of configs/etcd.conf.yml."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pegaflow.connector.settings import ConnectorSettings

from pegaflow.config import SECTIONS, ClusterConfig, load_config

K8S = Path(__file__).resolve().parents[2] / "configs" / "k8s"
KUBERNETES_VERSION = "1.30.0"
MANIFESTS = sorted(K8S.glob("*.yaml"))


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def resource(kind: str, name: str) -> dict[str, Any]:
    for path in MANIFESTS:
        for d in docs(path):
            if d["kind"] == kind and d["metadata"]["name"] == name:
                return d
    raise AssertionError(f"no {kind} {name} in {K8S}")


def containers(d: dict[str, Any]) -> list[dict[str, Any]]:
    return d["spec"]["template"]["spec"]["containers"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid(path: Path) -> None:
    for d in docs(path):
        kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_embedded_configs_and_variables_are_real_options(path: Path, tmp_path: Path) -> None:
    for d in docs(path):
        if d["kind"] == "ConfigMap":
            for key, text in d["data"].items():
                if key.endswith(".toml"):
                    (tmp_path / key).write_text(text)
                    load_config(tmp_path / key, env={})
        if d["kind"] in ("Deployment", "DaemonSet"):
            for c in containers(d):
                for name, value in env_of(c).items():
                    if name.startswith("PEGAFLOW_") and isinstance(value, str):
                        load_config(env={name: value})  # a bad value raises
                    if name.startswith("PEGAFLOW_"):
                        assert _is_option(name), f"{path.name}: {name} is no PegaFlow option"


def test_vllm_deployment_uses_the_node_on_its_host() -> None:
    node_ds = resource("DaemonSet", "pegaflow-node")
    vllm = resource("Deployment", "vllm")
    (c,) = containers(vllm)
    env = env_of(c)
    node_env = env_of(containers(node_ds)[0])
    # no node id to configure: the connector finds its host's node by the pool file the
    # node publishes (path, device, inode); the node's id stays stable across restarts
    assert "PEGAFLOW_CLIENT_LOCAL_NODE" not in env
    assert node_env["PEGAFLOW_NODE_NODE_ID"] == "$(HOSTNAME_)"
    assert node_env["HOSTNAME_"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # the pod's own network and IPC namespaces
    pod = vllm["spec"]["template"]["spec"]
    for shared in ("hostNetwork", "hostIPC", "hostPID"):
        assert not pod.get(shared), f"the vLLM pod sets {shared}"
    # the pool file's directory: the host's, at the node's shm_dir, in both pods
    node_toml = tomllib.loads(resource("ConfigMap", "pegaflow-node")["data"]["node.toml"])
    shm_dir = node_toml["node"].get("shm_dir", ClusterConfig().node.shm_dir)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = [n for n, p in mounts.items() if p == shm_dir]
    assert shm and volumes[shm[0]]["hostPath"]["path"] == shm_dir
    node_pod = node_ds["spec"]["template"]["spec"]
    node_vols = {v["name"]: v for v in node_pod["volumes"]}
    node_mounts = {m["mountPath"]: m["name"] for m in containers(node_ds)[0]["volumeMounts"]}
    assert node_vols[node_mounts[shm_dir]]["hostPath"]["path"] == shm_dir
    # scheduled where the DaemonSet runs
    assert pod["nodeSelector"] == node_pod["nodeSelector"]
    # the three-key --kv-transfer-config, a fixed hash seed, settings that load
    args = c["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv == {
        "kv_connector": "PegaKVConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "pegaflow.connector",
    }
    assert env["PYTHONHASHSEED"].isdigit()
    literal = {k: v for k, v in env.items() if isinstance(v, str)}
    s = ConnectorSettings.load({}, env=literal)
    assert s.coordinators == ["pegaflow-coordinator.pegaflow.svc:7700"]
    assert s.local_node == ""  # found by itself
    service = resource("Service", "pegaflow-coordinator")
    assert s.coordinators[0] == f"{_service_dns(service)}:{_service_port(service, 'control')}"


def test_node_daemonset_binds_and_advertises_the_host_address(tmp_path: Path) -> None:
    node_ds = resource("DaemonSet", "pegaflow-node")
    pod = node_ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # etcd-N.etcd.pegaflow.svc resolve
    (c,) = containers(node_ds)
    env = env_of(c)
    # the data plane binds and is published at the host's IP, explicitly
    assert env["PEGAFLOW_NODE_HOST"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    text = resource("ConfigMap", "pegaflow-node")["data"]["node.toml"]
    (tmp_path / "node.toml").write_text(text)
    cfg = load_config(tmp_path / "node.toml", env={"PEGAFLOW_NODE_HOST": "10.0.0.2"})
    assert cfg.node.host == "10.0.0.2"
    # the HTTP endpoint follows [node] host (empty http_host): the kubelet probes the pod
    # IP, which with hostNetwork is the host's; never loopback
    assert cfg.node.http_host in ("", cfg.node.host, "0.0.0.0")
    assert not cfg.node.http_host.startswith("127.")
    ports = {p["name"]: p for p in c["ports"]}
    assert ports["ucx"]["containerPort"] == ports["ucx"]["hostPort"] == cfg.node.ucx_port
    assert ports["http"]["containerPort"] == ports["http"]["hostPort"] == cfg.node.http_port
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and "host" not in get
        assert get["port"] in (cfg.node.http_port, "http")


def test_etcd_statefulset_serves_the_endpoints_the_configmaps_name(tmp_path: Path) -> None:
    sts = resource("StatefulSet", "etcd")
    svc = resource("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"  # headless: one DNS name per member
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    ns = sts["metadata"]["namespace"]
    assert svc["metadata"]["namespace"] == ns == "pegaflow"
    replicas = sts["spec"]["replicas"]
    assert replicas >= 3 and replicas % 2 == 1
    client_port = _service_port(svc, "client")
    members = {
        f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}.{ns}.svc:{client_port}"
        for i in range(replicas)
    }
    for name, key in (("pegaflow-node", "node.toml"), ("pegaflow-coordinator", "coordinator.toml")):
        (tmp_path / key).write_text(resource("ConfigMap", name)["data"][key])
        endpoints = load_config(tmp_path / key, env={}).etcd.endpoints
        assert endpoints and set(endpoints) <= members, (name, endpoints)

    (c,) = containers(sts)
    assert c["image"].startswith(("quay.io/coreos/etcd:v3.5.", "registry.k8s.io/etcd:3.5."))
    flags = _flags(c["args"])
    conf = yaml.safe_load((K8S.parent / "etcd.conf.yml").read_text())
    assert flags["auto-compaction-mode"] == conf["auto-compaction-mode"] == "periodic"
    assert flags["auto-compaction-retention"] == conf["auto-compaction-retention"] == "1h"
    assert int(flags["quota-backend-bytes"]) == conf["quota-backend-bytes"]
    if "max-txn-ops" in conf:
        assert int(flags["max-txn-ops"]) >= max(1024, conf["max-txn-ops"])
    node_cfg = load_config(tmp_path / "node.toml", env={})
    assert int(flags.get("max-txn-ops", 128)) >= node_cfg.etcd.batch_size
    # every member: its own name, advertised under the headless Service, in the cluster
    env = env_of(c)
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert flags["name"] == "$(POD_NAME)"
    assert flags["advertise-client-urls"] == (
        f"http://$(POD_NAME).{svc['metadata']['name']}.{ns}.svc:{client_port}"
    )
    peers = dict(m.split("=", 1) for m in flags["initial-cluster"].split(","))
    peer_port = _service_port(svc, "peer")
    assert peers == {
        f"{sts['metadata']['name']}-{i}": (
            f"http://{sts['metadata']['name']}-{i}.{svc['metadata']['name']}.{ns}.svc:{peer_port}"
        )
        for i in range(replicas)
    }
    assert svc["spec"].get("publishNotReadyAddresses") is True  # members find each other
    assert sts["spec"].get("podManagementPolicy") == "Parallel"  # and start together
    # its data on a volume of its own, probes on /health
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert flags["data-dir"].startswith(mounts[claim["metadata"]["name"]] + "/")
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"].split("?")[0] == "/health"
        port = named.get(get["port"], get["port"])
        assert port in (2379, int(flags.get("listen-metrics-urls", ":-1").rsplit(":", 1)[1]))


def _flags(args: list[str]) -> dict[str, str]:
    """``--key=value`` arguments as a dict (every etcd flag here is written that way)."""
    out = {}
    for a in args:
        assert a.startswith("--") and "=" in a, a
        key, value = a[2:].split("=", 1)
        out[key] = value
    return out


def _service_dns(service: dict[str, Any]) -> str:
    return f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"


def _service_port(service: dict[str, Any], name: str) -> int:
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == name]
    return port


def _is_option(name: str) -> bool:
    if name in ("PEGAFLOW_CONFIG",):
        return True
    cfg = ClusterConfig()
    for section in SECTIONS:
        prefix = f"PEGAFLOW_{section.upper()}_"
        if name.startswith(prefix):
            return name[len(prefix) :].lower() in getattr(cfg, section).__dataclass_fields__
    prefix = "PEGAFLOW_CONNECTOR_"
    return name.startswith(prefix) and name[len(prefix) :].lower() in ConnectorSettings.keys()
