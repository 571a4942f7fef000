#!/usr/bin/env bash
# Collect every wheel Loom needs beside the site's PyTorch stack into DIR, for a machine with
# no package index (an air-gapped GPU node): then `scripts/setup.sh --offline DIR --system-torch`
# there. Run it here, where PyPI is reachable, for the target's Python and platform.
#
#   scripts/wheelhouse.sh DIR [--python 3.12] [--platform manylinux2014_x86_64]
#                             [--with tracking,hf,data,sweeps,lightning|all] [--deepspeed 0.19.8]
#                             [--torch 2.13.0+cu128]
#
# Left out: torch and what it requires, numpy, and PyTorch Lightning's stack (a CUDA PyTorch
# image has them; `--with lightning` adds Lightning and numpy for a machine that has only torch).
# Resolved for the site's torch (--torch; default: the interpreter's), under this machine's pip
# constraints; a package that needs a newer torch is named and the build stops (exit 2).
# The core set (no --with) is what `loom train ... tracking=csv` needs. DIR/manifest.txt lists
# every wheel with its version, size and the group that needs it; DIR/manifest.json the same.
# Building deepspeed's wheel (DS_BUILD_OPS=0) runs its setup.py, which wants torch: the
# interpreter is $PYTHON, else the repo's .venv/bin/python, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
if ! "$PY" -c "import pip, packaging" 2>/dev/null; then
  echo "wheelhouse: $PY has no pip or packaging; set PYTHON to an interpreter with both (scripts/setup.sh makes .venv)" >&2
  exit 2
fi
exec "$PY" scripts/wheelhouse.py "$@"
