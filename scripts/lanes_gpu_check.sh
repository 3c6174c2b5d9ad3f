#!/usr/bin/env bash
# The lanes across processes on a GPU machine (docs/laneformer.md, "Lanes on several devices"), in one command:
#   the peer-mailbox test (2 and 4 processes sharing GPU 0, or one GPU each where there are enough), the
#   laneformer-2b check against the one-process model (fp32 with 2, 4 and 8 processes; bf16 with 2, decisive
#   steps; llama-3.2-1b as tensor parallelism, bf16 with 2), and the worker's lane-parallel engine against the
#   one-process engine (tiny-laneformer, and tiny-qwen3 as tensor parallelism).
#   Results in $OUT (default /tmp/lanes_gpu_check): tests.log and checks.log; exit status 1 when one failed.
#   Each stage runs under a timeout (STAGE_S, default 240 s) so that a hang is a failure, not a stuck machine.
#   STAGES picks among "tests checks engine scaling" (default all; each part fits a 10-minute command alone).
#   scaling: the decode table of each of SCALING_MODELS (default laneformer-2b, llama-3.2-1b and qwen3-1.7b), the
#   one-GPU runner and 1 and 2 ranks of the fast path (SCALING_PROCS; on one GPU they share it, which checks the
#   command, not the scaling; on 8: "1 2 4 8").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lanes_gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
if ! $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "lanes_gpu_check: needs a CUDA GPU and a torch built for it" >&2
  exit 2
fi
STAGE_S=${STAGE_S:-240}
STAGES=${STAGES:-"tests checks engine scaling"}
SCALING_PROCS=${SCALING_PROCS:-"1 2"}
SCALING_MODELS=${SCALING_MODELS:-"laneformer-2b llama-3.2-1b qwen3-1.7b"}
failed=0
stage() {  # stage LOG CMD...: one stage under the timeout, its output appended to LOG and shown
  local log=$1; shift
  echo "== $*" | tee -a "$log"
  timeout "$STAGE_S" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "FAILED ($rc): $*" | tee -a "$log"; failed=1; }
}
nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv | tee "$OUT/checks.log"
if [[ " $STAGES " == *" tests "* ]]; then
  # each case starts its processes afresh (20 with a GPU a process, 2 where they share one): TESTS_S
  STAGE_S=${TESTS_S:-560} stage "$OUT/tests.log" $PY -m pytest -q -p no:cacheprovider --noconftest \
    tests/kernels/test_kernels_peer_exchange.py tests/engine/test_lanes_peer.py tests/engine/test_lane_rank.py
fi
if [[ " $STAGES " == *" checks "* ]]; then
  for procs in 2 4 8; do
    stage "$OUT/checks.log" $PY -m inference.bench.lanes_check --model laneformer-2b --procs "$procs" --mode peer
  done
  for model in laneformer-2b llama-3.2-1b; do
    stage "$OUT/checks.log" $PY -m inference.bench.lanes_check --model "$model" --procs 2 --mode peer \
      --dtype bfloat16
  done
fi
if [[ " $STAGES " == *" engine "* ]]; then
  for model in tiny-laneformer tiny-qwen3; do
    for backend in fast reference; do
      stage "$OUT/checks.log" $PY -m inference.bench.lanes_check --engine --model "$model" --procs 2 \
        --mode peer --backend "$backend"
    done
  done
fi
if [[ " $STAGES " == *" scaling "* ]]; then
  for model in $SCALING_MODELS; do
    # shellcheck disable=SC2086 - SCALING_PROCS is a list
    stage "$OUT/checks.log" $PY -m inference.bench.lanes_scaling --model "$model" --procs $SCALING_PROCS \
      --prompt-len 512 --new-tokens 256 --json "$OUT/scaling-$model.json"
  done
fi
exit $failed
