#!/usr/bin/env bash
# Run the test suite (sets up etcd and .venv first, builds the sdist and the wheel into
# dist/); about 30 min on a 2-core machine.
# Extra arguments go to pytest: `scripts/test.sh tests/unit` is the quick suite (about
# 1.5 min), `scripts/test.sh -m "not vllm"` everything but the vLLM engines (README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
# the sdist and the wheel (built from it) into dist/: tests/integration/test_install.py
# installs this wheel into a fresh environment
scripts/build.sh dist >/dev/null
export PEGAFLOW_DIST="$PWD/dist"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
