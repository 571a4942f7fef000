#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (extra arguments go to pytest).
# The session ends with the launch-budget table (tests/launches.py) and the 20 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export WANDB_MODE=offline WANDB_SILENT=true
exec .venv/bin/python -m pytest --durations=20 "$@"
