#!/usr/bin/env bash
# Run the test suite (sets up etcd and .venv first). Extra arguments go to pytest,
# e.g. `scripts/test.sh -m "not slow"` skips the real-vLLM end-to-end tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
