#!/usr/bin/env bash
# One prepared run for a GPU machine (issue 40), about 8 minutes on one H100 or H200:
#   1. the card (nvidia-smi);
#   2. nxdt on Llama-3.2-1B: bf16 (mixed_precision), compiled blocks, the fused output layer + loss
#      (cross_entropy_chunk_size), through benchmarks/throughput.py --device cuda: tokens/s, MFU against
#      the card's published dense bf16 peak, and the peak memory the run's memory report prints;
#   3. the same for Llama-3.1-8B cut to its first 8 layers (seq 8192, full activation checkpointing:
#      the throughput.py shape llama-3.1-8b-8l), what one card holds with fp32 weights and AdamW;
#   4. torchtitan's own figure for the 1B shape in the same run (benchmarks/peer_titan.py --titan-flavor:
#      its llama3 1B, bf16 autocast, its per-block compile; its tokens/s, its MFU, peak memory), where a
#      python with torchtitan is found (--titan-python, else .venv-peers-titan, else --python); else a line
#      saying why it was not run.
#
#   bash benchmarks/gpu.sh                # everything
#   bash benchmarks/gpu.sh --dry-run      # print the commands, run nothing
#   bash benchmarks/gpu.sh --only 1b,titan --steps 10 --python /path/to/python
#
# Goal (issue 40): nxdt >= 45% MFU on the 1B (torchtitan publishes 33-39% bf16 on the 8B).
set -uo pipefail

cd "$(dirname "$0")/.."
usage="usage: bash benchmarks/gpu.sh [--dry-run] [--only 1b,8b,titan] [--steps N] [--python PATH] [--titan-python PATH]"
DRY=0
ONLY="1b,8b,titan"
STEPS=20
PY=""
TITAN_PY=""
die() { echo "gpu.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --only) [ $# -ge 2 ] || die "--only needs a value (from 1b,8b,titan)"; ONLY="$2"; shift ;;
    --steps) [ $# -ge 2 ] || die "--steps needs a value"; STEPS="$2"; shift ;;
    --python) [ $# -ge 2 ] || die "--python needs a path"; PY="$2"; shift ;;
    --titan-python) [ $# -ge 2 ] || die "--titan-python needs a path"; TITAN_PY="$2"; shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) die "unknown argument '$1' ($usage)" ;;
  esac
  shift
done
case "$STEPS" in ''|*[!0-9]*|0) die "--steps: a whole number >= 1 (got '$STEPS')" ;; esac
for part in ${ONLY//,/ }; do
  case "$part" in 1b|8b|titan) ;; *) die "--only: from 1b,8b,titan (got '$ONLY')" ;; esac
done
wants() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ -z "$TITAN_PY" ]; then
  if [ -x .venv-peers-titan/bin/python ]; then TITAN_PY=.venv-peers-titan/bin/python; else TITAN_PY="$PY"; fi
fi

run() {  # print the command; run it unless --dry-run; 8 minutes in all: each part has its own cap
  local cap="$1"; shift
  echo "+ $*"
  [ "$DRY" = 1 ] && return 0
  timeout "$cap" "$@"
  local rc=$?
  [ $rc -eq 124 ] && echo "gpu.sh: stopped after ${cap}s: $*"
  return $rc
}

nxdt_shape() {  # throughput.py on one shape; then the peak memory lines of its worker's report
  local shape="$1" cap="$2" log
  log=$(mktemp)
  run "$cap" env PYTHONPATH=src "$PY" benchmarks/throughput.py --device cuda --shape "$shape" \
    --ways nxdt-mixed-chunks-compile --repeats 1 --steps "$STEPS" --warmup-steps 3 --keep | tee "$log"
  if [ "$DRY" = 0 ]; then
    local dir
    dir=$(sed -n 's/^worker logs: //p' "$log" | tail -1)
    [ -n "$dir" ] && grep -hiE "peak|memory" "$dir"/*.log | grep -viE "warn|deprecat" | tail -4
  fi
  rm -f "$log"
}

status=0
run 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || status=1
wants 1b && { nxdt_shape llama-3.2-1b 180 || status=1; }
wants 8b && { nxdt_shape llama-3.1-8b-8l 150 || status=1; }
if wants titan; then
  if [ "$DRY" = 1 ] || "$TITAN_PY" -c "import torchtitan.models.llama3" >/dev/null 2>&1; then
    run 120 "$TITAN_PY" benchmarks/peer_titan.py --titan-flavor 1B --titan-seq 2048 --titan-batch 4 \
      --titan-compile --device cuda --steps "$STEPS" --warmup 3 || status=1
  else
    why=$("$TITAN_PY" -c "import torchtitan.models.llama3" 2>&1 | tail -1)
    echo "torchtitan's figure not run: $TITAN_PY cannot import torchtitan.models.llama3: ${why:-not found}"
  fi
fi
exit $status
