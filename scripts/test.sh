#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (extra arguments go to pytest).
#   scripts/test.sh [pytest args]           the whole suite, one process (CI: .ci/run)
#   scripts/test.sh --quick [pytest args]   the quick tier: every test that starts no training run
#                                           (-m "not launch"), over 2 pytest-xdist workers with one
#                                           torch thread each, a test file per worker at a time
# The session ends with the budgets table (tests/launches.py: launches and seconds per file against
# tests/budget.toml, the load average) and the 20 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export WANDB_MODE=offline WANDB_SILENT=true
if [ "${1:-}" = "--quick" ]; then
  shift
  export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
  exec .venv/bin/python -m pytest -m "not launch" -n "${LOOM_TEST_WORKERS:-2}" --dist loadfile --durations=20 "$@"
fi
exec .venv/bin/python -m pytest --durations=20 "$@"
