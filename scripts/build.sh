#!/usr/bin/env bash
# Build the sdist, then the wheel from that sdist (so the sdist is known to hold every
# package), into OUTDIR (default dist/, emptied of earlier builds first):
#   scripts/build.sh [OUTDIR]
# Offline: no build isolation, the build backend (setuptools) of $PYTHON's environment
# (default .venv/bin/python, as scripts/setup.sh makes it).
set -euo pipefail
out="$(realpath -m "${1:-dist}")"
cd "$(dirname "$0")/.."
rm -f "$out"/pegaflow_cluster-*
"${PYTHON:-.venv/bin/python}" -m build --no-isolation --outdir "$out" . >&2
ls "$out"/pegaflow_cluster-*.tar.gz "$out"/pegaflow_cluster-*.whl
