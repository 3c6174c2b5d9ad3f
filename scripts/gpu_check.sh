#!/usr/bin/env bash
# Everything the fast path must show, in one command on a GPU machine:
#   the benchmark with the teacher-forced check and the per-kernel breakdown for llama-3.2-1b, qwen3-1.7b and
#   laneformer-2b at 512 tokens of prompt, decode at ~4096 tokens of context and prefill at 4094, the kernel
#   and runner tests compiled in bf16, and a short table last.
#   Results go to $OUT (default /tmp/gpu_check): bench.log, tests.log, results.json, summary.txt.
#
#   scripts/gpu_check.sh                 # everything (about 10 minutes; BUDGET_S caps it, stages that would
#                                        # start past it are skipped and say so)
#   PEERS=1 scripts/gpu_check.sh         # also the torch.compile and HF transformers peers (minutes more)
#   MODELS="llama-3.2-1b" TESTS=0 LONG_MODELS="" scripts/gpu_check.sh
#   MODELS="" TESTS=0 WORKER_MODELS="" PEAKED_MODELS="" DEFAULT_CHECK=0 LONG_MODELS="laneformer-2b" \
#     TTFT_FLAGS="--prefill-profile" scripts/gpu_check.sh   # one model's long context alone (an empty list skips)
#   BENCH_FLAGS="" PEERS=1 LONG_MODELS="" TESTS=0 DEFAULT_CHECK=0 scripts/gpu_check.sh   # the peers alone
#   WORKER_MODELS="llama-3.2-1b"       # the worker streaming into a real Redis vs the benchmark (needs the redis
#                                      # package and a redis-server on PATH; default: llama-3.2-1b)
#   PEER_MODELS="llama-3.2-1b"         # peers for these models only, after everything else
#   TTFT_FLAGS="--prefill-profile"     # where the long prefill's GPU time goes, by kernel
#   PEAKED_MODELS="llama-3.2-1b"       # the check on these presets with --init peaked (synth.make_peaked: logits
#                                      # with a trained model's margins); "" skips them
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# the project's venv where `make` made one, else the machine's python3 (PYTHON= overrides both)
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
if ! $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: needs a CUDA GPU and a torch built for it ($PY has none; PYTHON=... picks another)" >&2
  exit 2
fi
MODELS=${MODELS-"llama-3.2-1b laneformer-2b qwen3-1.7b"}
LONG_MODELS=${LONG_MODELS-"laneformer-2b llama-3.2-1b qwen3-1.7b"}
TESTS=${TESTS:-1}
PEERS=${PEERS:-0}
DEFAULT_CHECK=${DEFAULT_CHECK:-1}
BENCH_FLAGS=${BENCH_FLAGS-"--check --breakdown"}
BUDGET_S=${BUDGET_S:-560}
PEAKED_MODELS=${PEAKED_MODELS-"llama-3.2-1b laneformer-2b qwen3-1.7b"}

# run LIMIT_S CMD...: runs CMD under a timeout that ends by the budget; skipped when under 30 s remain.
run() {
  local limit=$1; shift
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 30 ]; then echo "SKIPPED (budget): $*" | tee -a "$OUT/bench.log"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/bench.log"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/bench.log"
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/bench.log"

if [ "$TESTS" = 1 ]; then
  # one test process a core, up to 16, where pytest-xdist is installed: compiling the kernels is most of it (on a
  # fresh machine most of the tests finish in 300 s; on Triton's warm cache all of them in about a minute).
  # TESTS_S moves the limit.
  parallel=""
  cores=$(nproc)
  $PY -c 'import xdist' 2>/dev/null && parallel="-n $((cores < 16 ? cores : 16))"
  timeout "${TESTS_S:-300}" $PY -m pytest -q -p no:cacheprovider --noconftest $parallel \
    tests/kernels tests/engine/test_fast_runner.py > "$OUT/tests.log" 2>&1
  tail -4 "$OUT/tests.log" | tee -a "$OUT/bench.log"
fi
for model in ${WORKER_MODELS-llama-3.2-1b}; do
  run 200 $PY scripts/bench_worker.py --model "$model" --json "$OUT/worker.$model.json" --log "$OUT/worker.log"
done
peers=""
[ "$PEERS" = 1 ] && peers="--peers"
[ -n "${PEER_KINDS:-}" ] && peers="--peers $PEER_KINDS"
for model in $MODELS; do
  run 300 $PY -m inference.bench --model "$model" $BENCH_FLAGS $peers --json "$OUT/$model.512.json"
done
# the check again on peaked random weights: random presets' flat logits leave the argmax rule meaningless
for model in $PEAKED_MODELS; do
  run 150 $PY -m inference.bench --model "$model" --init peaked --check --no-pdl-row --runs 2 --new-tokens 16 \
    --json "$OUT/$model.peaked.json"
done
# the correctness check on the trained default model too (a small Laneformer; text it was trained on)
if [ "$DEFAULT_CHECK" = 1 ] && [ -f models/default/config.json ]; then
  run 120 $PY -m inference.bench --model models/default --check --no-pdl-row --json "$OUT/default.512.json"
fi
for model in $LONG_MODELS; do
  # decode with ~4096 tokens of context (the prompt ends 256 tokens short of it), and prefill at 4094
  run 90 $PY -m inference.bench --model "$model" --prompt-len 3840 --new-tokens 256 --no-pdl-row \
    --json "$OUT/$model.4096.json"
  [ "${TTFT_LONG:-1}" = 1 ] && run 60 $PY -m inference.bench --model "$model" --prompt-len 4094 --new-tokens 2 \
    --no-pdl-row --runs 5 ${TTFT_FLAGS:-} --json "$OUT/$model.ttft4094.json"
done
for model in ${PEER_MODELS:-}; do
  run 400 $PY -m inference.bench --model "$model" --no-pdl-row --peers --json "$OUT/$model.peers.json"
done
$PY - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
merged = {}
lines = ["| model | prompt+new | ceiling tok/s | best fast tok/s | % of ceiling | no PDL | whole bf16 head | engine path | sampled (page) | sampled, whole head | TTFT ms | check |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
SAMPLED_PREFIX = "fast, runner contract, sampled"  # inference.bench.timing.SAMPLED_ROW_PREFIX (no torch import here)
PAGE_WHOLE_HEAD = "fast, runner contract, page sampling, full bf16 head"  # inference.bench.timing.PAGE_WHOLE_HEAD_ROW
worker_lines = []
for f in sorted(out.glob("*.json")):
    if f.name == "results.json":
        continue
    r = json.loads(f.read_text())
    merged[f.stem] = r
    if f.name.startswith("worker."):
        worker_lines.append(f"worker -> Redis, {r['model']}: {r['worker_tok_s']:,.0f} tok/s vs benchmark "
                            f"{r['bench_tok_s']:,.0f} ({100 * r['ratio']:.1f}%) -> {'PASS' if r['passed'] else 'FAIL'}")
        continue
    rows = {row["path"]: row for row in r["rows"]}
    sampled = next((path for path in rows if path.startswith(SAMPLED_PREFIX)), "")
    # the greedy head read whole (inference.bench's row beside the head screen's; the PDL row itself without one)
    whole = next((path for path in rows if path.startswith("fast, CUDA graph") and path.endswith("full bf16 head")),
                 "fast, CUDA graph, PDL")

    def tok(path):
        row = rows.get(path, {})
        return f"{row['tok_s']:,.0f}" if "tok_s" in row else row.get("error", "-")[:40]

    best = max((row for row in r["rows"] if row["path"].startswith("fast, CUDA graph") and "tok_s" in row),
               key=lambda row: row["tok_s"], default={})
    pct = f"{100 * best['tok_s'] / r['ceiling_tok_s']:.1f}%" if "tok_s" in best else "-"
    c = r.get("check", {})
    verdict = (f"bf16 {'PASS' if c['passed'] else 'FAIL'} {c['max_rel_err']:.1e}/{100 * c['argmax_agree']:.1f}%; "
               f"fp32 {'PASS' if c.get('passed_fp32') else 'FAIL'} {c.get('fp32_max_rel_err', 0):.1e}/"
               f"{100 * c.get('fp32_argmax_agree', 0):.1f}%"
               + (f"; screen {100 * c['screen_same_token']:.1f}%" if c.get("screen_same_token") is not None else "")
               if "passed" in c else c.get("error", "")[:40])
    ttft = f"{best['ttft_ms']:.1f}" if "ttft_ms" in best else "-"
    same = rows.get(sampled, {}).get("same_tokens_as_full_head")
    sampled_whole = tok(PAGE_WHOLE_HEAD) + (f" (same draws {100 * same:.1f}%)" if same is not None else "")
    best_tok = f"{best['tok_s']:,.0f}" if "tok_s" in best else "-"
    name = r["model"] + (" (peaked)" if r.get("init") == "peaked" else "")
    lines.append(f"| {name} | {r['prompt_len']}+{r['new_tokens']} | {r['ceiling_tok_s']:,.0f} | "
                 f"{best_tok} | {pct} | {tok('fast, CUDA graph, no PDL')} | {tok(whole)} | "
                 f"{tok('fast, runner contract (engine path)')} | {tok(sampled)} | {sampled_whole} | {ttft} | "
                 f"{verdict} |")
    for row in r["rows"]:
        if not row["path"].startswith("fast"):
            lines.append(f"|   {row['path']} | | | {tok(row['path'])} | | | | | | | | |")
(out / "results.json").write_text(json.dumps(merged, indent=1))
for f in out.glob("*.json"):
    if f.name != "results.json":
        f.unlink()
print("\n".join(lines + worker_lines))
PYEOF
