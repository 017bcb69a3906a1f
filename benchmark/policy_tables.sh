#!/usr/bin/env bash
# The cache-policy tables of docs/serving.md ("Results: CPU (2 cores), ShareGPT multi-turn" and
# "Reasoning variant"), each one bench_serving.py command: policies compared with each other on
# one server build, 2 interleaved rounds, percentiles pooled. Needs `make install`. Writes
# results/policy_tables/ (a .md table and a .json with every request per command).
#   bash benchmark/policy_tables.sh                 # ~12 min on the 2-core dev machine
#   OUT=results/s26/policy bash benchmark/policy_tables.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-results/policy_tables}
mkdir -p "$OUT"
source benchmark/machine.sh
machine_header "$OUT/machine.txt"
echo "commit: $(git rev-parse --short HEAD)" | tee -a "$OUT/machine.txt"
common=(--num-sessions 10 --max-output-len 16 --ascii-only --rounds 2)
table() {  # name, then bench_serving.py arguments
  local name=$1
  shift
  echo "## $name" | tee "$OUT/$name.md"
  "$PY" benchmark/bench_serving.py "${common[@]}" "$@" --json "$OUT/$name.json" | tee -a "$OUT/$name.md"
}
table tiny_256MB --launch marconi,sglang+,vllm+,none
table tiny_40MB --launch marconi,sglang+ --server-args "--model tiny --cache-memory 40MB"
table small_512MB --launch marconi,sglang+,none --server-args "--model small --cache-memory 512MB"
table reasoning --launch marconi,marconi-paper,sglang+ --reasoning-share 0.5
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt"
