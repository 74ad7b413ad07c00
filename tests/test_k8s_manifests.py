"""The Kubernetes manifests in configs/k8s: valid resources (kubernetes-validate, strict,
offline schemas), their embedded configs load, every PEGAFLOW_* variable they set is a
real option, and the vLLM Deployment fits the node DaemonSet it relies on."""

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

K8S = Path(__file__).resolve().parent.parent / "configs" / "k8s"
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
    # the local node's id: the one the DaemonSet gives its node, from the downward API
    assert env["PEGAFLOW_CLIENT_LOCAL_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert node_env["PEGAFLOW_NODE_NODE_ID"] == "$(HOSTNAME_)"
    assert node_env["HOSTNAME_"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # the pool file's directory: the host's, at the node's shm_dir, in both pods
    node_toml = tomllib.loads(resource("ConfigMap", "pegaflow-node")["data"]["node.toml"])
    shm_dir = node_toml["node"].get("shm_dir", ClusterConfig().node.shm_dir)
    pod = vllm["spec"]["template"]["spec"]
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
    s = ConnectorSettings.load({}, env={**literal, "PEGAFLOW_CLIENT_LOCAL_NODE": "gpu-host-1"})
    assert s.coordinators == ["pegaflow-coordinator.pegaflow.svc:7700"]
    assert s.local_node == "gpu-host-1"
    service = resource("Service", "pegaflow-coordinator")
    assert s.coordinators[0].startswith(f"{service['metadata']['name']}.pegaflow.svc:")


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
