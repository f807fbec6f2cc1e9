#!/usr/bin/env bash
# Set up (with the test tools) and run the whole test suite; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
