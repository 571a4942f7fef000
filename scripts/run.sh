#!/usr/bin/env bash
# Set up .venv if needed, then run the default job (extra arguments are Hydra overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/loom train "$@"
