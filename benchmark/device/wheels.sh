#!/usr/bin/env bash
# Python 3.12 wheels that the lent GPU machine lacks (it has torch, tokenizers, safetensors,
# httpx and an older transformers, no internet, and takes up to 64 MiB of carried files): our
# server's web stack and transformers at the version the equivalence test pins (5.17's torch
# reference normalises the Mamba-2 gated norm over all groups at once, and the check then fails
# on the reference, not on us: seen in session 27). Versions are read from .venv, so the device
# runs what the tests here ran. ~26 MB in .whl/ (git-ignored through .git/info/exclude); then
#   device run: carry [".whl"], command `OUT=$OUT bash benchmark/device/check_runtime.sh python3`
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
NAMES="fastapi starlette pydantic pydantic_core typing-inspection annotated-types annotated-doc
uvicorn opentelemetry-api typing_extensions transformers huggingface_hub kernels hf-xet httpx2
httpcore2 truststore tomlkit click idna anyio regex"
pins=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null | tr '[:upper:]' '[:lower:]' | tr _ -)
args=()
for name in $NAMES; do
  key=$(echo "$name" | tr '[:upper:]' '[:lower:]' | tr _ -)
  pin=$(grep -m1 "^$key==" <<<"$pins") || { echo "wheels: $name is not in .venv" >&2; exit 1; }
  args+=("$pin")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${args[@]}"
du -sh .whl
