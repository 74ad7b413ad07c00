#!/usr/bin/env bash
# Run the test suite (sets up etcd and .venv first); about 27 min on a 2-core machine.
# Extra arguments go to pytest: `scripts/test.sh -m "not vllm"` is the quick suite (no
# vLLM engines; README.md says how long it takes), `scripts/test.sh tests/unit` one folder.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
