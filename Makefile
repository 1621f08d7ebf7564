# Everything starts from a bare Python 3.11: each target builds .venv first if needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_MODEL := .cache/models/tiny-llama

.PHONY: test demo lint format bench-throughput clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The pinned CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q

$(DEMO_MODEL)/config.json: $(STAMP)
	$(BIN)/tidegate make-tiny-model $(DEMO_MODEL) --arch llama --size tiny

demo: $(DEMO_MODEL)/config.json
	$(BIN)/tidegate generate --model $(DEMO_MODEL) --dtype bfloat16 --max-tokens 24 \
		--prompt "The tide comes in" --prompt "A cluster of machines" \
		--prompt "Once upon a time, in a data center far away,"

lint: $(STAMP)
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench-throughput: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py --out benchmarks/results/offline_throughput.json

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
