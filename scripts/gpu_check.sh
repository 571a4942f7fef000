#!/usr/bin/env bash
# What a maintainer runs on a new GPU machine, one command:
# - one GPU: a few bf16-mixed steps of every strategy that fits one device (single, ddp, fsdp,
#   zero1, zero2, zero3, zero3_offload), then scripts/bench/gpu_mfu.py and gpu_memory.py;
# - 2+ GPUs, besides: ddp, fsdp, fsdp_tp, zero2, zero3, pp and nd at the machine's world size
#   (every visible GPU), and a SIGKILL of one rank mid-run that must resume and complete;
# - float8 (FLOAT8=tensorwise by default; FLOAT8= skips it, as does a python without torchao): a
#   compiled single-GPU run in float8=$FLOAT8 beside the same run in bf16 (float8_compiled and
#   bf16_compiled: tokens/s and MFU in the table), and gpu_mfu.py's float8 pair (--float8).
# Writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.md (one row per check) and keeps the run
# dirs under OUT_DIR/runs/ (rank logs, summary.json) for whatever failed. tracking=csv: it never
# needs wandb, datasets or the sweeper (a core install from scripts/wheelhouse.sh is enough).
#
#   scripts/gpu_check.sh [OUT_DIR]          (default: gpu_check_out/)
#   STEPS=20 MODEL=gpt_small STRATEGIES="single fsdp" MULTI="ddp fsdp" SKIP_BENCH=1 scripts/gpu_check.sh out/
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
MULTI="${MULTI:-ddp fsdp fsdp_tp zero2 zero3 pp nd}"
FLOAT8="${FLOAT8-tensorwise}"
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

rm -rf "$OUT/runs"  # a run id left by an earlier check would resume (or be "already completed"), not train
mkdir -p "$OUT/runs"
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true
results="$OUT/results.tsv"
: > "$results"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
COMMON=(hardware=auto hardware.precision=bf16-mixed "model=$MODEL" trainer.log_every_n_steps=5
        trainer.limit_val_batches=1 tracking=csv experiment=gpu_check "run.root=$OUT/runs")

# check ID ARGS...: one `loom train`, its exit code and wall time into results.tsv.
check() {
  local id="$1"; shift
  echo "gpu_check: $id ($STEPS steps, bf16-mixed, $MODEL)"
  local start=$(date +%s)
  "$PY" -m loom.cli train "${COMMON[@]}" "trainer.max_steps=$STEPS" checkpoint.every_n_steps=0 \
    "run.id=$id" "$@" > "$OUT/runs/$id.out" 2>&1
  printf '%s\t%s\t%s\n' "$id" "$?" "$(( $(date +%s) - start ))" >> "$results"
}

# A rank SIGKILLed after the step-5 checkpoint: torchrun restarts the ranks, which resume and finish.
kill_and_resume() {
  local id=sigkill_resume dir="$OUT/runs/gpu_check/sigkill_resume" start=$(date +%s) pid=""
  echo "gpu_check: $id (ddp on $GPUS GPUs, rank $((GPUS - 1)) SIGKILLed after step 5)"
  "$PY" -m loom.cli train "${COMMON[@]}" strategy=ddp "hardware.devices=$GPUS" trainer.max_steps=30 \
    checkpoint.every_n_steps=5 hardware.max_restarts=1 "run.id=$id" > "$OUT/runs/$id.out" 2>&1 &
  local launcher=$!
  for _ in $(seq 600); do
    [ -f "$dir/checkpoints/step-0000005.ckpt" ] && break
    kill -0 "$launcher" 2>/dev/null || break
    sleep 0.5
  done
  pid=$(grep -ho "loom INFO: rank $((GPUS - 1)) (pid [0-9]*) started" "$dir/logs/rank-$((GPUS - 1)).log" 2>/dev/null \
        | tail -1 | grep -o "pid [0-9]*" | cut -d" " -f2)
  [ -n "$pid" ] && kill -9 "$pid"
  wait "$launcher"
  printf '%s\t%s\t%s\n' "$id" "$?" "$(( $(date +%s) - start ))" >> "$results"
}

for s in $STRATEGIES; do check "$s" "strategy=$s" hardware.devices=1; done
if [ -n "$FLOAT8" ] && ! "$PY" -c "import torchao" 2>/dev/null; then
  echo "gpu_check: float8 skipped: $PY cannot import torchao (the float8 extra)"; FLOAT8=""
fi
if [ -n "$FLOAT8" ]; then  # the float8 leg: the same compiled run in bf16 and in float8
  check bf16_compiled strategy=single hardware.devices=1 trainer.compile=true
  check "float8_${FLOAT8}_compiled" strategy=single hardware.devices=1 trainer.compile=true "float8=$FLOAT8"
fi
if [ "$GPUS" -ge 2 ]; then
  for s in $MULTI; do
    extra=()
    [ "$s" = nd ] && { if [ "$GPUS" -ge 4 ]; then extra=(strategy.tp=2 strategy.pp=2); else extra=(strategy.pp=2); fi; }
    check "${s}_x$GPUS" "strategy=$s" "hardware.devices=$GPUS" "${extra[@]}"
  done
  kill_and_resume
fi

mfu_rc=skipped mem_rc=skipped
if [ -z "${SKIP_BENCH:-${SKIP_MFU:-}}" ]; then
  echo "gpu_check: scripts/bench/gpu_mfu.py"
  "$PY" scripts/bench/gpu_mfu.py --json "$OUT/gpu_mfu.json" ${FLOAT8:+--float8 "$FLOAT8"} > "$OUT/gpu_mfu.out" 2>&1
  mfu_rc=$?
  echo "gpu_check: scripts/bench/gpu_memory.py"
  "$PY" scripts/bench/gpu_memory.py --json "$OUT/gpu_memory.json" > "$OUT/gpu_memory.out" 2>&1
  mem_rc=$?
fi

"$PY" - "$OUT" "$results" "$mfu_rc" "$mem_rc" <<'EOF'
"""Gather the runs' summary.json into gpu_check.json and a markdown table; exit 1 on a failure."""
import json, sys
from pathlib import Path

out, results, bench_rc = Path(sys.argv[1]), Path(sys.argv[2]), {"gpu_mfu": sys.argv[3], "gpu_memory": sys.argv[4]}
rows, ok = [], True
for line in results.read_text().splitlines():
    run_id, rc, wall = line.split("\t")
    path = out / "runs" / "gpu_check" / run_id / "summary.json"
    s = json.loads(path.read_text()) if path.exists() else {}
    t, m = s.get("throughput") or {}, s.get("memory") or {}
    passed = rc == "0" and s.get("status") == "completed"
    if run_id == "sigkill_resume":  # it must have been killed, restarted and resumed
        passed &= s.get("restarts") == 1 and (s.get("resumed_from_step") or 0) >= 5
    ok &= passed
    first = lambda key: (m.get(key) or [None])[0]
    rows.append({"check": run_id, "passed": passed, "exit": int(rc), "wall_s": int(wall),
                 "world": s.get("world_size"), "final_loss": s.get("final_loss"),
                 "tokens_per_sec": t.get("tokens_per_sec"), "mfu": t.get("mfu"),
                 "peak_gpu_mem_gb": first("peak_gpu_mem_gb_per_rank"),
                 "peak_gpu_reserved_gb": first("peak_gpu_reserved_gb_per_rank"),
                 "float8": (s.get("float8") or {}).get("converted"), "log": f"runs/{run_id}.out"})
for bench, rc in bench_rc.items():
    if rc == "skipped":
        continue
    ok &= rc == "0"
    res = out / f"{bench}.json"
    rows.append({"check": f"scripts/bench/{bench}.py", "passed": rc == "0", "exit": int(rc),
                 "result": json.loads(res.read_text()) if res.exists() else None, "log": f"{bench}.out"})
(out / "gpu_check.json").write_text(json.dumps({"passed": ok, "checks": rows}, indent=2) + "\n")

def cell(v):
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

cols = ["check", "passed", "exit", "wall_s", "world", "final_loss", "tokens_per_sec", "mfu", "peak_gpu_mem_gb",
        "peak_gpu_reserved_gb", "float8", "log"]
md = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
md += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
(out / "gpu_check.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
print(f"gpu_check: {'all checks passed' if ok else 'FAILED'}; {out / 'gpu_check.json'}, {out / 'gpu_check.md'}")
sys.exit(0 if ok else 1)
EOF
