#!/usr/bin/env bash
# Quick start: set up, train the demo model on the built-in Shakespeare corpus, print what it learned.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/phalanx train
.venv/bin/phalanx generate runs/demo "ROMEO:" --max-new-tokens 200 --seed 0
