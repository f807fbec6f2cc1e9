#!/usr/bin/env bash
# Set up .venv with the test tools and run the tests (times measured on 2 cores: TESTING.md).
#   bash scripts/test.sh                 the quick tier: every folder, real processes and servers, no test
#                                        over about 20 s (tests marked `slow` are left out)
#   bash scripts/test.sh --all           the whole suite (what CI runs), with llama-cpp-python installed
#   bash scripts/test.sh [--all] ARGS    ARGS go to pytest: paths, -k EXPR, -x, --time-limit=SECONDS, ...
# Two pytest workers (pytest-xdist) share the tests a file at a time, so a module's fixtures are made
# once: on 2 cores that took the whole suite from 36 to 22 minutes, since many tests wait on processes
# they start. TEST_WORKERS=N sets the count (0: no workers, every test in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
workers=(-n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)  # longest files first: tests/timing.py
if [ "${1:-}" = "--all" ]; then
  shift
  EXTRAS=test-all bash scripts/setup.sh
  exec .venv/bin/python -m pytest -q "${workers[@]}" "$@"
fi
EXTRAS=test bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "${workers[@]}" -m "not slow" "$@"
