#!/usr/bin/env bash
# GPU check of the hybrid model runtime (never needed by CI): equivalence + resume tests on CUDA,
# then the speed benchmark on CUDA. Usage: benchmark/device/check_runtime.sh [python]
# Writes logs under ${OUT:-/tmp/marconi-device}.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-${PY:-.venv/bin/python}}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-/tmp/marconi-device}
mkdir -p "$OUT"
export MARCONI_CACHE_DIR="$OUT/cache"
# the device's own python3 (torch, transformers, safetensors, tokenizers preinstalled) imports
# marconi from this checkout; no install, nothing to carry
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$PY" benchmark/device/check_runtime_cuda.py 2>&1 | tee "$OUT/equivalence.txt"
timeout 300 "$PY" benchmark/bench_model.py --device cuda --models tiny,150m --lengths 512,2048,8192 \
  --threads 1 --reps 3 --decode-steps 32 2>&1 | grep -v -i warn | tee "$OUT/bench.txt"
