#!/usr/bin/env bash
# Make .venv with everything Loom needs. Idempotent: a second call returns at once.
# Order matters: CPU torch first (an unpinned torch pulls GBs of CUDA wheels), then
# deepspeed without build isolation (its setup imports torch), then Loom itself.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LOOM_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.loom-setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0

echo "[setup] creating $VENV ..." >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip setuptools wheel
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
pip install -q numpy packaging ninja
if ! "$VENV/bin/python" -c "import deepspeed" 2>/dev/null; then
  DS_BUILD_OPS=0 pip install -q --no-build-isolation "${DEEPSPEED_SPEC:-deepspeed}"
fi
pip install -q -e ".[dev]"
rm -f "$VENV"/.loom-setup-*
touch "$stamp"
echo "[setup] done" >&2
