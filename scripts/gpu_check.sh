#!/usr/bin/env bash
# What a maintainer runs on a new GPU machine: a few bf16-mixed steps of every strategy that fits
# one device (single, ddp, fsdp, zero1, zero2, zero3, zero3_offload), then scripts/bench/gpu_mfu.py.
# Writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.md (one row per check) and keeps the run dirs
# under OUT_DIR/runs/ (rank logs, summary.json) for whatever failed.
#
#   scripts/gpu_check.sh [OUT_DIR]          (default: gpu_check_out/)
#   STEPS=20 MODEL=gpt_small STRATEGIES="single fsdp" SKIP_MFU=1 scripts/gpu_check.sh out/
#
# Exit codes: 0 every check passed; 1 a check failed (the table says which); 2 the interpreter
# cannot run Loom (no such python, or no torch: nothing was checked, and it is not "no GPU");
# 4 skipped: torch sees no CUDA device, nothing was run (a distinct code so a caller can tell
# "not checked" from "passed").
# Python: $PYTHON, else the repo's .venv/bin/python (as scripts/test.sh and scripts/bench/ use),
# else python3 (a GPU image's own interpreter with its site torch); the first line says which.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check_out}"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"; WHY="\$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; WHY="the repo's venv"
else PY=python3; WHY="no \$PYTHON and no .venv"; fi
STEPS="${STEPS:-20}"
MODEL="${MODEL:-gpt_small}"
STRATEGIES="${STRATEGIES:-single ddp fsdp zero1 zero2 zero3 zero3_offload}"
EXIT_SKIPPED=4
EXIT_NO_PYTHON=2

echo "gpu_check: python: $PY ($WHY)"
if ! command -v "$PY" > /dev/null 2>&1; then
  echo "gpu_check: $PY is not an interpreter here: set PYTHON=/path/to/python (exit $EXIT_NO_PYTHON)"
  exit "$EXIT_NO_PYTHON"
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "gpu_check: $PY cannot import torch: install the site's CUDA torch there or set PYTHON to one that has it; nothing was checked (exit $EXIT_NO_PYTHON)"
  exit "$EXIT_NO_PYTHON"
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: skipped: no CUDA device visible to torch ($PY); nothing was run (exit $EXIT_SKIPPED)"
  exit "$EXIT_SKIPPED"
fi

mkdir -p "$OUT/runs"
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true
results="$OUT/results.tsv"
: > "$results"
for s in $STRATEGIES; do
  echo "gpu_check: strategy=$s ($STEPS steps, bf16-mixed, $MODEL)"
  start=$(date +%s)
  "$PY" -m loom.cli train hardware=auto hardware.devices=1 hardware.precision=bf16-mixed \
    "strategy=$s" "model=$MODEL" "trainer.max_steps=$STEPS" trainer.log_every_n_steps=5 \
    checkpoint.every_n_steps=0 trainer.limit_val_batches=1 tracking=csv experiment=gpu_check \
    "run.root=$OUT/runs" "run.id=$s" > "$OUT/runs/$s.out" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$s" "$rc" "$(( $(date +%s) - start ))" >> "$results"
done

mfu_rc=skipped
if [ -z "${SKIP_MFU:-}" ]; then
  echo "gpu_check: scripts/bench/gpu_mfu.py"
  "$PY" scripts/bench/gpu_mfu.py --json "$OUT/gpu_mfu.json" > "$OUT/gpu_mfu.out" 2>&1
  mfu_rc=$?
fi

"$PY" - "$OUT" "$results" "$mfu_rc" <<'EOF'
"""Gather the runs' summary.json into gpu_check.json and a markdown table; exit 1 on a failure."""
import json, sys
from pathlib import Path

out, results, mfu_rc = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
rows, ok = [], True
for line in results.read_text().splitlines():
    strategy, rc, wall = line.split("\t")
    path = out / "runs" / "gpu_check" / strategy / "summary.json"
    s = json.loads(path.read_text()) if path.exists() else {}
    t, m = s.get("throughput") or {}, s.get("memory") or {}
    passed = rc == "0" and s.get("status") == "completed"
    ok &= passed
    gpu_mem = (m.get("peak_gpu_mem_gb_per_rank") or [None])[0]
    rows.append({"check": f"strategy={strategy}", "passed": passed, "exit": int(rc), "wall_s": int(wall),
                 "final_loss": s.get("final_loss"), "tokens_per_sec": t.get("tokens_per_sec"),
                 "mfu": t.get("mfu"), "peak_gpu_mem_gb": gpu_mem, "log": f"runs/{strategy}.out"})
if mfu_rc != "skipped":
    ok &= mfu_rc == "0"
    mfu = out / "gpu_mfu.json"
    rows.append({"check": "scripts/bench/gpu_mfu.py", "passed": mfu_rc == "0", "exit": int(mfu_rc),
                 "result": json.loads(mfu.read_text()) if mfu.exists() else None, "log": "gpu_mfu.out"})
(out / "gpu_check.json").write_text(json.dumps({"passed": ok, "checks": rows}, indent=2) + "\n")

def cell(v):
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

cols = ["check", "passed", "exit", "wall_s", "final_loss", "tokens_per_sec", "mfu", "peak_gpu_mem_gb", "log"]
md = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
md += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
(out / "gpu_check.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
print(f"gpu_check: {'all checks passed' if ok else 'FAILED'}; {out / 'gpu_check.json'}, {out / 'gpu_check.md'}")
sys.exit(0 if ok else 1)
EOF
