# Everything starts from a bare Python 3.11: each target builds .venv first if needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_MODEL := .cache/models/tiny-llama

.PHONY: test demo lint format bench bench-throughput bench-startup bench-prefill-stall \
	bench-shared-prefix bench-attention bench-peers clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The pinned CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q

$(DEMO_MODEL)/config.json: $(STAMP)
	$(BIN)/tidegate make-tiny-model $(DEMO_MODEL) --arch llama --size tiny

# Serves the tiny model with `tidegate serve` (what the operator runs in a pod), sends one
# chat request, and keeps serving until Ctrl-C. DEMO_PORT=... picks another port.
DEMO_PORT ?= 8000
demo: $(DEMO_MODEL)/config.json
	$(BIN)/tidegate demo --model $(DEMO_MODEL) --port $(DEMO_PORT)

lint: $(STAMP)
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench-throughput: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py --out benchmarks/results/offline_throughput.json

bench-startup: $(STAMP)
	$(BIN)/python benchmarks/serve_startup.py --out benchmarks/results/serve_startup.json

bench-prefill-stall: $(STAMP)
	$(BIN)/python benchmarks/prefill_stall.py

bench-shared-prefix: $(STAMP)
	$(BIN)/python benchmarks/shared_prefix.py

# CUDA only: the Triton attention kernel against SDPA (correctness first, then timings).
bench-attention: $(STAMP)
	$(BIN)/python benchmarks/attention.py --check --out benchmarks/results/attention.json

# Every scenario that needs no peer engine; each writes benchmarks/results/ and the README table.
bench: bench-prefill-stall bench-shared-prefix bench-throughput bench-startup

# Peer engines for comparison, each in its own venv under .cache/peers (vLLM's CPU build first),
# then the scenarios that compare against them.
bench-peers: $(STAMP)
	bash benchmarks/peers/setup_vllm.sh
	$(BIN)/python benchmarks/offline_throughput.py --with-vllm \
		--out benchmarks/results/offline_throughput.json
	$(BIN)/python benchmarks/serving_vs_vllm.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
