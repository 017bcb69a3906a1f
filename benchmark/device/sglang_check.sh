#!/usr/bin/env bash
# GPU check of the SGLang plugin (never needed by CI; one model fits one 10-minute device call).
# Builds the tiny random Nemotron-H and Jamba (HF format, `marconi.models.tiny`: `tiny`,
# `tiny-jamba`), launches SGLang 0.5.23 twice per model -- `--prefix-cache lru` (SGLang's default
# cache) and `--prefix-cache marconi` -- replays the same short multi-turn workload
# (sglang_replay.py) and prints hit rate and TTFT side by side. `tiny-jamba` is served by the
# plugin's JambaForCausalLM (docs/sglang.md); SGLang picks `no_buffer` Mamba caching for it.
# MODELS="tiny" or MODELS="tiny-jamba" runs one model (default: both, one after the other); extra
# server flags for the Jamba runs go in JAMBA_FLAGS.
#
# Needs an environment with the full `sglang==0.5.23` CUDA stack and this repo's plugin installed
# (the script installs the plugin with `pip install -e python`). The device machine has no internet and a carry limit of
# 64 MiB, far below SGLang's ~4.7 GB of CUDA wheels (torch 2.14.1, flashinfer, sglang-kernel, ...):
# run it in the docker/Dockerfile image or on a GPU host that already has them. Without sglang it
# exits 2 and says so. Usage: benchmark/device/sglang_check.sh [python]; logs in ${OUT:-/tmp/...}.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-${PY:-python3}}
OUT=${OUT:-/tmp/marconi-sglang-check}
mkdir -p "$OUT"
export MARCONI_CACHE_DIR="$OUT/cache"
if ! "$PY" -c "import sglang, torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "sglang_check: needs sglang==0.5.23 with CUDA torch in $PY (not carried: ~4.7 GB)" >&2
  exit 2
fi
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e python >/dev/null
MODELS=${MODELS:-tiny tiny-jamba}
PORT=30000
run() {  # $1 = model folder, $2 = label, rest = extra server flags
  local model=$1 label=$2; shift 2
  "$PY" -m sglang.launch_server --model-path "$model" --skip-tokenizer-init --port $PORT \
    --mem-fraction-static 0.3 --max-running-requests 16 --log-level warning "$@" \
    >"$OUT/server-${label//\//-}.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $pid 2>/dev/null || { tail -30 "$OUT/server-${label//\//-}.log"; return 1; }
    sleep 2
  done
  timeout 150 "$PY" benchmark/device/sglang_replay.py --url "http://127.0.0.1:$PORT" \
    --label "$label" | tee -a "$OUT/results.jsonl"
  kill $pid; wait $pid 2>/dev/null || true
  grep -m3 "marconi" "$OUT/server-${label//\//-}.log" || true
}
: >"$OUT/results.jsonl"
for name in $MODELS; do
  model=$("$PY" -c "from marconi.models.tiny import ensure_tiny; print(ensure_tiny('$name'))")
  extra=()
  [[ $name == tiny-jamba ]] && read -ra extra <<<"${JAMBA_FLAGS:-}"
  run "$model" "$name/lru" --prefix-cache lru "${extra[@]}"
  run "$model" "$name/marconi" --prefix-cache marconi --marconi-alpha 1.0 "${extra[@]}"
done
"$PY" - "$OUT/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'model/cache':<22}{'hit rate':>10}{'TTFT P50 ms':>14}{'TTFT P95 ms':>14}")
for r in rows:
    print(f"{r['label']:<22}{r['hit_rate']:>10.3f}{r['ttft_p50_ms']:>14.2f}{r['ttft_p95_ms']:>14.2f}")
PY
