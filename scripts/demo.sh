#!/usr/bin/env bash
# The main job: set up (etcd, .venv), then bring up a local cluster and use it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
