#!/usr/bin/env bash
# Make .venv with everything Loom needs. Idempotent: a second call returns at once.
#
#   scripts/setup.sh                                  from the package index (CPU torch unless one is there)
#   scripts/setup.sh --offline DIR [--system-torch]   from a wheelhouse (scripts/wheelhouse.sh), no index
#
# Online, order matters: CPU torch first (an unpinned torch pulls GBs of CUDA wheels), then
# deepspeed without build isolation (its setup imports torch), then Loom itself.
# Offline, --system-torch makes a venv that sees the torch of $PYTHON (default python3): the
# site's CUDA build, never replaced; without it, DIR must hold a torch wheel. The torch found
# must be in pyproject.toml's range; numpy and PyTorch Lightning come from the site too unless
# the wheelhouse was built --with lightning. Extras whose wheels DIR holds are installed with Loom.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LOOM_VENV:-.venv}
PY=${PYTHON:-python3}
OFFLINE="" SYSTEM_TORCH=""
while [ $# -gt 0 ]; do
  case "$1" in
    --offline) OFFLINE="${2:?--offline needs the wheelhouse DIR}"; shift 2 ;;
    --system-torch) SYSTEM_TORCH=1; shift ;;
    *) echo "setup: unknown argument $1 (usage: scripts/setup.sh [--offline DIR [--system-torch]])" >&2; exit 2 ;;
  esac
done
fail() { echo "setup: $*" >&2; exit 2; }
stamp="$VENV/.loom-setup-$(cat pyproject.toml setup.py scripts/setup.sh | sha1sum | cut -c1-12)${OFFLINE:+-offline}"
[ -f "$stamp" ] && exit 0
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
TORCH_MIN=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)

# "ok" when the interpreter's torch is at least TORCH_MIN, else what it has ("none", a version).
torch_state() {
  "$1" - "$TORCH_MIN" <<'PYEOF' 2>/dev/null || echo none
import sys
try:
    import torch
except ImportError:
    print("none"); sys.exit()
have = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
need = tuple(int(p) for p in sys.argv[1].split(".")[:2])
print("ok" if have >= need else torch.__version__)
PYEOF
}

# A venv made from a venv does not see that venv's packages through --system-site-packages
# (only its base interpreter's): add them with a .pth line that runs site.addsitedir.
see_site_of() {
  local own
  own=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  "$1" - "$own/_loom_system_torch.pth" <<'PYEOF'
import site, sys
if sys.prefix != sys.base_prefix:
    with open(sys.argv[1], "w") as f:
        f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site.getsitepackages()) + "\n")
PYEOF
}

# The wheelhouse was resolved for one torch (manifest.json "torch"): say so when the venv has another.
same_torch_as_wheelhouse() {
  "$VENV/bin/python" - "$OFFLINE/manifest.json" <<'PYEOF' >&2
import json, sys
from importlib.metadata import version
want, have = json.load(open(sys.argv[1])).get("torch"), version("torch")
if want and want.split("+")[0] != have.split("+")[0]:
    print(f"setup: warning: {sys.argv[1]} was resolved for torch {want}, this venv has torch {have}: a package "
          f"there may need another torch; rebuild it with scripts/wheelhouse.sh DIR --torch {have}")
PYEOF
}

offline_install() {
  [ -f "$OFFLINE/manifest.json" ] || fail "$OFFLINE has no manifest.json: build it with scripts/wheelhouse.sh $OFFLINE --python <the target's X.Y>"
  local state
  if [ -n "$SYSTEM_TORCH" ]; then
    state=$(torch_state "$PY")
    [ "$state" = none ] && fail "--system-torch: $PY cannot import torch; install the site's CUDA torch for it, or set PYTHON=/path/to/python that has it"
    [ "$state" = ok ] || fail "--system-torch: $PY has torch $state, outside Loom's supported range (torch>=$TORCH_MIN, pyproject.toml)"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
    see_site_of "$PY"
  else
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    ls "$OFFLINE"/torch-*.whl > /dev/null 2>&1 || fail "$OFFLINE holds no torch wheel: use --system-torch to keep the interpreter's torch, or put the site's torch wheel there"
    pip install -q --no-index --find-links "$OFFLINE" torch
  fi
  state=$(torch_state "$VENV/bin/python")
  [ "$state" = ok ] || fail "the new venv $VENV cannot use torch (found: $state)"
  same_torch_as_wheelhouse
  local extras
  extras=$("$VENV/bin/python" -c "import json, sys; m = json.load(open(sys.argv[1])); print(','.join(sorted({w['group'] for w in m['wheels']} - {'core', 'build', 'lightning'})))" "$OFFLINE/manifest.json")
  "$VENV/bin/python" -c "import setuptools, wheel" 2>/dev/null || pip install -q --no-index --find-links "$OFFLINE" "setuptools>=64" wheel
  pip install -q --no-index --find-links "$OFFLINE" --no-build-isolation -e ".${extras:+[$extras]}" \
    || fail "pip could not install Loom from $OFFLINE alone (above: the package it lacks); numpy and pytorch-lightning must be on $PY or in the wheelhouse (scripts/wheelhouse.sh ... --with lightning)"
}

online_install() {
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip install -q --upgrade pip setuptools wheel
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  fi
  pip install -q numpy packaging ninja
  if ! "$VENV/bin/python" -c "import deepspeed" 2>/dev/null; then
    DS_BUILD_OPS=0 pip install -q --no-build-isolation "${DEEPSPEED_SPEC:-deepspeed}"
  fi
  pip install -q -e ".[dev,docs]"   # docs: mkdocs for .ci/run (the offline path installs only the wheelhouse's extras)
  # The tests' reference writer/reader of Megatron's indexed format (tests/test_data_store.py); --no-deps
  # because its dependency list pulls a CUDA stack: only the CPU-importable indexed_dataset module is used.
  pip install -q --no-deps "megatron-core"
}

echo "[setup] creating $VENV${OFFLINE:+ from $OFFLINE (no index)} ..." >&2
if [ -n "$OFFLINE" ]; then offline_install; else online_install; fi
rm -f "$VENV"/.loom-setup-*
touch "$stamp"
echo "[setup] done" >&2
