#!/usr/bin/env bash
# Build models/default from scratch on one H200 in under 10 minutes (inference/train_default.py: corpus,
# tokenizer, repeat check, final training of the default size; the size sweep only with --sweep), writing
# to $OUT only what comes back: the bf16 weights' shards (model-0000i-of-0000n.safetensors, each under
# 16 MiB), default-rest.tar (config, tokenizer, generation config, training.json, loss.png, train.log) and
# run.log (everything printed).
#
#   OUT=/path/to/out bash scripts/train_default.sh          # on the GPU machine, from the repository root
#   python scripts/install_default.py /path/to/out          # here: unpack into models/default
set -euo pipefail
out="${OUT:?OUT: the folder to write the packed checkpoint to}"
mkdir -p "$out"
# cuBLAS reads it when it first starts: deterministic GEMM workspaces for the repeatable curve
export CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -m inference.train_default --out /tmp/default --pack "$out" --budget-minutes 9.2 "$@" 2>&1 \
    | tee "$out/run.log" | grep -v -i warning | tail -n 80
echo "--- repeat check and result:"
grep -E "repeatability|torch.compile failed|SUMMARY" "$out/run.log" || true
