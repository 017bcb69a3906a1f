# The two contracts: `make sim` (set up + run the main job), `make test` (set up + run the tests).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
TRACES ?= ../shared/traces

.PHONY: install test lint sim bench-sim serve clean

install: $(STAMP)

$(STAMP): python/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e "python[dev]"
	touch $(STAMP)

test: install
	$(PY) -m pytest -q test

lint: install
	$(VENV)/bin/ruff check python test benchmark
	$(VENV)/bin/ruff format --check python test benchmark

# Main job until the server lands: a policy sweep on a shipped real trace.
sim: install
	$(VENV)/bin/marconi-sim sweep --trace mooncake --model paper-7b --out results/sweep

# The OpenAI-compatible server on the embedded default model (http://127.0.0.1:30000/v1).
serve: install
	$(PY) -m marconi.launch_server --model tiny --prefix-cache marconi

bench-sim: install
	$(PY) benchmark/bench_sim.py --out docs/results.md

clean:
	rm -rf $(VENV) results .pytest_cache
