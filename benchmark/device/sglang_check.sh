#!/usr/bin/env bash
# SGLang with the marconi plugin, lru vs marconi, measured with SGLang's own bench_serving.
# The same script runs here on CPU (DEVICE=cpu, the default when torch sees no GPU) and on a lent
# GPU (DEVICE=cuda): only the device differs. Per model folder (MODELS, default "tiny
# tiny-jamba"; the embedded HF folders of marconi.models.tiny, tokenizer included) it starts
# `python -m sglang.launch_server --model-path FOLDER --prefix-cache {lru,marconi} --device
# $DEVICE`, runs `python -m sglang.bench_serving --dataset-name generated-shared-prefix` (shared
# system prompts, multi-turn; GSP_* below), keeps the JSONL results, and prints TTFT P50/P95,
# ITL P50 and the cached-token fraction side by side; then marconi's benchmark/bench_serving.py
# ShareGPT multi-turn replay against the same servers and (OURS_PY=.venv/bin/python) against
# marconi's own engine. Servers run one at a time; CACHES (default "lru marconi", also
# "marconi-paper") picks them.
#
# Needs sglang==0.5.23 + the plugin in $PY (here: `make install-sglang`, PY=.venv-sglang/bin/python;
# on a GPU host: SGLang's CUDA stack, e.g. the docker/Dockerfile image). Logs and results in $OUT.
# Usage: [DEVICE=cpu|cuda] [MODELS="tiny"] benchmark/device/sglang_check.sh [python]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-${PY:-.venv-sglang/bin/python}}
OUT=${OUT:-/tmp/marconi-sglang-check}
mkdir -p "$OUT"
export MARCONI_CACHE_DIR=${MARCONI_CACHE_DIR:-$OUT/cache}
if ! "$PY" -c "import sglang, marconi.integrations.sglang" 2>/dev/null; then
  echo "sglang_check: needs sglang==0.5.23 and marconi in $PY (make install-sglang)" >&2
  exit 2
fi
DEVICE=${DEVICE:-$("$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}
MODELS=${MODELS:-tiny tiny-jamba}
GSP=(--gsp-num-groups "${GSP_GROUPS:-4}" --gsp-prompts-per-group "${GSP_PER_GROUP:-4}"
  --gsp-system-prompt-len "${GSP_SYSTEM:-512}" --gsp-question-len "${GSP_QUESTION:-48}"
  --gsp-output-len "${GSP_OUTPUT:-16}" --gsp-num-turns "${GSP_TURNS:-3}")
POOL=(--max-total-tokens 65536 --max-mamba-cache-size 64)
[[ $DEVICE == cuda ]] && POOL=(--mem-fraction-static 0.3)
PORT=${PORT:-30000}
echo "device=$DEVICE cpu=$(lscpu | sed -n 's/^Model name: *//p') models=$MODELS gsp=${GSP[*]}"
run() {  # $1 = model folder, $2 = label, rest = extra server flags
  local model=$1 label=$2; shift 2
  local log="$OUT/server-${label//\//-}.log"
  "$PY" -m sglang.launch_server --model-path "$model" --device "$DEVICE" --port "$PORT" \
    --enable-cache-report "${POOL[@]}" "$@" >"$log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $pid 2>/dev/null || { tail -30 "$log"; return 1; }
    sleep 2
  done
  "$PY" -m sglang.bench_serving --backend sglang-oai-chat --base-url "http://127.0.0.1:$PORT" \
    --model "$model" --tokenizer "$model" --dataset-name generated-shared-prefix "${GSP[@]}" \
    --request-rate "${RATE:-inf}" --max-concurrency "${CONCURRENCY:-4}" --seed 1 \
    --cache-report --disable-tqdm --output-file "$OUT/bench-${label//\//-}.jsonl" \
    >"$OUT/bench-${label//\//-}.txt" 2>&1 || { tail -30 "$OUT/bench-${label//\//-}.txt"; }
  # marconi's own multi-turn ShareGPT replay (text completions) against the same server
  "$PY" benchmark/bench_serving.py --base-url "http://127.0.0.1:$PORT" --model "$model" \
    --trace sharegpt --num-sessions "${REPLAY_SESSIONS:-6}" --max-output-len 16 --ascii-only \
    --json "$OUT/replay-${label//\//-}.json" >"$OUT/replay-${label//\//-}.txt" 2>&1 \
    || tail -5 "$OUT/replay-${label//\//-}.txt"
  kill $pid; wait $pid 2>/dev/null || true
  grep -m2 "marconi:" "$log" || true
}
for name in $MODELS; do
  model=$("$PY" -c "from marconi.models.tiny import ensure_tiny; print(ensure_tiny('$name'))")
  for cache in ${CACHES:-lru marconi}; do  # marconi-paper: the paper's design
    case $cache in
      marconi-paper) run "$model" "$name/$cache" --prefix-cache marconi --marconi-preset marconi-paper ;;
      *) run "$model" "$name/$cache" --prefix-cache "$cache" ;;
    esac
  done
  # the same replay against marconi's own engine and server (OURS_PY: its venv; CPU only)
  if [[ -n ${OURS_PY:-} && $DEVICE == cpu ]]; then
    "$OURS_PY" benchmark/bench_serving.py --launch marconi --server-args "--model $name" \
      --trace sharegpt --num-sessions "${REPLAY_SESSIONS:-6}" --max-output-len 16 --ascii-only \
      --json "$OUT/replay-$name-engine.json" >"$OUT/replay-$name-engine.txt" 2>&1 \
      || tail -5 "$OUT/replay-$name-engine.txt"
  fi
done
"$PY" - "$OUT" $MODELS <<'PY'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
print(f"{'sglang.bench_serving (gsp)':<28}{'TTFT P50':>9}{'TTFT P95':>9}{'ITL P50':>8}{'cached':>8}{'req':>5}")
for name in sys.argv[2:]:
    for cache in ("lru", "marconi", "marconi-paper"):
        f = out / f"bench-{name}-{cache}.jsonl"
        if not f.is_file():
            if cache != "marconi-paper":
                print(f"{name}/{cache}: no result")
            continue
        r = json.loads(f.read_text().splitlines()[-1])
        # the cached-token totals are in bench_serving's printed "Cache Hit Details"
        text = f.with_suffix(".txt").read_text()
        tot = {k: int(re.search(rf"Total {k} tokens:\s+(\d+)", text).group(1))
               for k in ("prompt", "cached")}
        print(f"{name + '/' + cache:<28}{r['median_ttft_ms']:>9.0f}{r['p95_ttft_ms']:>9.0f}"
              f"{r['median_itl_ms']:>8.0f}{tot['cached'] / tot['prompt']:>8.3f}{r['completed']:>5}")
print(f"\n{'bench_serving.py (sharegpt)':<28}{'TTFT P50':>9}{'TTFT P95':>9}{'ITL P50':>8}{'cached':>8}{'req':>5}")
for f in sorted(out.glob("replay-*.json")):
    for r in json.loads(f.read_text())["results"].values():
        t, i = r["ttft_ms"], r["itl_ms"]
        print(f"{f.stem.removeprefix('replay-'):<28}{t['p50']:>9.0f}{t['p95']:>9.0f}"
              f"{i['p50']:>8.0f}{r['cached_fraction']:>8.3f}{r['requests']:>5}")
PY
