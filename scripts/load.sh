#!/usr/bin/env bash
# Load this machine the way a developer's or a user's machine often is, to run the suite (or
# anything) beside it (issue 49): a 2-rank `loom train` (ddp, gloo, gpt_tiny) started again
# each time it ends, and N busy loops (default 2), until stopped (Ctrl-C, SIGTERM, or --seconds).
#
#   scripts/load.sh [--busy N] [--seconds S] [--log FILE]
#   scripts/load.sh & LOAD=$!; scripts/test.sh ...; kill $LOAD      # a suite under load
#
# Every minute (and at the end) it prints the 1-minute load average and the training runs done.
# The runs go to a temporary root removed at the end. Uses .venv (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
BUSY=2 SECONDS_LIMIT=0 LOG=/dev/stderr
while [ $# -gt 0 ]; do
  case "$1" in
    --busy) BUSY="${2:?--busy needs a count}"; shift 2 ;;
    --seconds) SECONDS_LIMIT="${2:?--seconds needs a number}"; shift 2 ;;
    --log) LOG="${2:?--log needs a file}"; shift 2 ;;
    *) echo "load: unknown argument $1 (usage: scripts/load.sh [--busy N] [--seconds S] [--log FILE])" >&2; exit 2 ;;
  esac
done
[ -x .venv/bin/loom ] || { echo "load: no .venv/bin/loom: run scripts/setup.sh first" >&2; exit 2; }
ROOT=$(mktemp -d "${TMPDIR:-/tmp}/loom-load.XXXXXX")
PIDS=()
stop() {
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  echo "load: stopped after $(ls "$ROOT/runs" 2>/dev/null | wc -l) training runs; load average $(cut -d' ' -f1-3 /proc/loadavg)" >>"$LOG"
  rm -rf "$ROOT"
  exit 0
}
trap stop EXIT INT TERM

# The training loop: a new run id each time (a finished run would not train again).
( set -m
  i=0
  while :; do
    i=$((i + 1))
    WANDB_MODE=offline .venv/bin/loom train hardware=cpu strategy=ddp hardware.devices=2 trainer.max_steps=300 \
      dataset.max_bytes=2000000 tracking=csv checkpoint.every_n_steps=0 trainer.limit_val_batches=0 \
      run.root="$ROOT" experiment=load run.id="load-$i" >/dev/null 2>&1 || sleep 1
    mkdir -p "$ROOT/runs" && touch "$ROOT/runs/$i"
  done ) &
PIDS+=($!)
for _ in $(seq 1 "$BUSY"); do
  ( while :; do :; done ) &
  PIDS+=($!)
done
echo "load: a 2-rank loom train loop and $BUSY busy loops (pids ${PIDS[*]}), runs under $ROOT" >>"$LOG"
started=$(date +%s)
while :; do
  sleep 60 & wait $! || true
  echo "load: $(( $(date +%s) - started )) s, load average $(cut -d' ' -f1-3 /proc/loadavg)" >>"$LOG"
  if [ "$SECONDS_LIMIT" -gt 0 ] && [ $(( $(date +%s) - started )) -ge "$SECONDS_LIMIT" ]; then break; fi
done
