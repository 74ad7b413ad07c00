#!/usr/bin/env bash
# Run the test suite (sets up etcd and .venv first); about 30 min on a 2-core machine.
# Extra arguments go to pytest: `scripts/test.sh tests/unit` is the quick suite (about
# 1.5 min), `scripts/test.sh -m "not vllm"` everything but the vLLM engines (README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
