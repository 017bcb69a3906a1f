#!/usr/bin/env bash
# Device check of the hybrid model runtime and our OpenAI server (never needed by CI). One call
# on a lent GPU runs it all: DEVICE defaults to cuda where torch sees one, else cpu, so the same
# script runs here and only the device differs. Each part runs even if an earlier one failed
# (a part past PART_TIMEOUT s gets SIGINT, so its script stops the servers it started); the
# exit status says whether any failed. Logs in ${OUT:-/tmp/marconi-device}:
#   layers.txt       ours on DEVICE vs ours on the CPU, module by module (diff_layers.py;
#                    diagnostic: prints, never fails)
#   equivalence.txt  HF-equivalence (fp32 with TF32 off at 1e-4; fp32 with torch's TF32
#                    defaults and bf16 reported) + resume from a copied state
#   tokens-*.txt     our server with vs without the cache, greedy, token for token, and its
#                    cached prompt tokens (benchmark/compare_tokens.py --no-vllm)
#   latency-*.txt    cold-prefill TTFT by prompt length and single-stream ITL, served
#                    (benchmark/bench_latency.py), cache on vs off
#   bench.txt        the model forward alone, prefill and decode (benchmark/bench_model.py)
# The device machine's python3 has torch, safetensors, tokenizers and httpx, an older
# transformers and not the server's web stack: `benchmark/device/wheels.sh` fetches the wheels
# into .whl, installed into /tmp/site when the stack is missing (carry [".whl"] in the call).
# Usage: [DEVICE=cuda|cpu] benchmark/device/check_runtime.sh [python]
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-${PY:-.venv/bin/python}}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-/tmp/marconi-device}
mkdir -p "$OUT"
export MARCONI_CACHE_DIR=${MARCONI_CACHE_DIR:-/tmp/marconi-device-cache} PYTHONUNBUFFERED=1
if ! "$PY" -c "import fastapi, uvicorn" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# marconi from this checkout, no install
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
DEVICE=${DEVICE:-$("$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}
export DEVICE
failed=()
part() {  # $1 = log name, rest = command; tee'd, timed (PART_TIMEOUT s), failure recorded
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  timeout -s INT -k 30 "${PART_TIMEOUT:-240}" "$@" 2>&1 | grep -v -i warn | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc, $((SECONDS - t0)) s"
  ((rc == 0)) || failed+=("$name")
}
"$PY" -c "import torch; d = '$DEVICE'; print(d, torch.__version__,
  torch.cuda.get_device_name() if d.startswith('cuda') else '')" | tee "$OUT/device.txt"
lscpu | sed -n 's/^Model name: *//p' | tee -a "$OUT/device.txt"
part layers "$PY" benchmark/device/diff_layers.py
part equivalence "$PY" benchmark/device/check_runtime_cuda.py
for model in ${MODELS:-tiny small}; do
  part "tokens-$model" "$PY" benchmark/compare_tokens.py --model "$model" --no-vllm \
    --device "$DEVICE" --conversations "${CONVERSATIONS:-4}" --turns 3
  part "latency-$model" "$PY" benchmark/bench_latency.py --launch marconi,none \
    --server-args "--model $model --cache-memory 2GB --device $DEVICE" \
    --lengths "${LENGTHS:-256,2048,8192}" --reps 2
done
part bench "$PY" benchmark/bench_model.py --device "$DEVICE" --models tiny,150m \
  --lengths 512,2048,8192 --threads 1 --reps 3 --decode-steps 32 --no-hf
echo "failed parts: ${failed[*]:-none}"
((${#failed[@]} == 0))
