# Everything starts from a bare Python 3.11: each target builds .venv first if needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_MODEL := .cache/models/tiny-llama

.PHONY: test test-quick demo lint format bench bench-throughput bench-startup bench-prefill-stall \
	bench-shared-prefix bench-kv-routing bench-disaggregated bench-attention bench-cpu-attention bench-compile \
	bench-closed-loop bench-peers clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The pinned CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[engine,operator,test,bench]'
	touch $(STAMP)

# checkov pins versions (packaging, jsonschema, ...) that clash with ours: its own venv.
CHECKOV := .cache/tools/checkov/bin/checkov
$(CHECKOV):
	$(PYTHON) -m venv .cache/tools/checkov
	.cache/tools/checkov/bin/pip install --quiet checkov==3.3.30

# The suite: lint, format, import layers, then the tests (bar the `slow` ones outside CI) in three runs
# (the marks are given in tests/conftest.py). First all but the e2e modules that kill, restart
# or time things, one test file per worker on each of the two cores (pytest-xdist; TEST_WORKERS=
# runs each run in one process); then the `paired` e2e modules (faults, restarts, P/D,
# `tidegate up`), two files at a time, since their deadlines hold beside one other such module
# but not beside the compiles of the first run; then the `alone` ones (ITL under a long
# prompt's arrival, deadlines, soak RSS, data parallel), by themselves: they assume a quiet
# machine. The image test (tests/images/test_images_run.py, `alone`) builds and runs the images
# with podman: tools/container_tools.sh installs it where it is missing and this is root.
TEST_WORKERS ?= -n 2 --dist loadfile
# Each run lists its slowest tests, to see what the suite's time goes to.
TEST_DURATIONS ?= --durations=15
# The heavy cases (the `slow` mark: benchmark smokes, compiles, CUDA-graph and Triton kernels
# in the interpreter, the wheel, the images, canaries) run in CI (CI=true, as .ci/run is run
# there) or with SLOW=1: about 17 minutes of pytest with them on 2 cores, 8 without.
NOT_SLOW := $(if $(filter 1 true,$(CI) $(SLOW)),,and not slow)
test: $(STAMP) $(CHECKOV)
	tools/container_tools.sh
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/pytest -q $(TEST_WORKERS) $(TEST_DURATIONS) -m "not paired and not alone $(NOT_SLOW)"
	$(BIN)/pytest -q $(TEST_WORKERS) $(TEST_DURATIONS) -m "paired $(NOT_SLOW)"
	$(BIN)/pytest -q $(TEST_DURATIONS) -m "alone $(NOT_SLOW)"

# The units only, to iterate with (about a minute on 2 cores): no model, no server, no other
# process, nothing slow. tests/conftest.py gives the marks it leaves out; the slowest five
# tests are listed, so that one that grew is seen.
test-quick: $(STAMP)
	$(BIN)/pytest -q -m "not e2e and not model and not slow" --durations=5

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

# The prefill-stall workload at fixed chunk thresholds, then the closed loop: fit the engine's
# step metrics (operator/step_fit.py), propose a threshold for the ITL SLO, restart, repeat.
bench-closed-loop: $(STAMP)
	$(BIN)/python benchmarks/closed_loop_tuning.py

# Three instances behind a router: routing by the blocks each holds against rendezvous hashing.
bench-kv-routing: $(STAMP)
	$(BIN)/python benchmarks/kv_routing.py

# Producer, consumer and router, one core per engine, against a unified server on one core.
bench-disaggregated: $(STAMP)
	$(BIN)/python benchmarks/disaggregated.py

# Offline throughput at compilation levels 0 and 1 (tiny and small models), and start-up
# times with a cold and a warm compile cache.
bench-compile: $(STAMP)
	$(BIN)/python benchmarks/compile.py --repeats 5 --out benchmarks/results/compile.json

# CUDA only: the Triton attention kernel against SDPA (correctness first, then timings).
bench-attention: $(STAMP)
	$(BIN)/python benchmarks/attention.py --check --out benchmarks/results/attention.json

# The C++ CPU paged-attention kernel against the torch backend, one layer of the small model.
bench-cpu-attention: $(STAMP)
	$(BIN)/python benchmarks/cpu_attention.py --out benchmarks/results/cpu_attention.json

# Every scenario that needs no peer engine; each writes benchmarks/results/ and the README table.
bench: bench-prefill-stall bench-shared-prefix bench-disaggregated bench-throughput \
	bench-startup

# Peer engines for comparison, each in its own venv under .cache/peers (vLLM's CPU build first),
# then the scenarios that compare against them.
bench-peers: $(STAMP)
	bash benchmarks/peers/setup_vllm.sh
	$(BIN)/python benchmarks/offline_throughput.py --with-vllm --compiled \
		--out benchmarks/results/offline_throughput.json
	$(BIN)/python benchmarks/serving_vs_vllm.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache

# The images (images/*.Dockerfile), built from the repository root with podman or docker,
# whichever is present (IMAGE_ENGINE=... picks one). `make images` builds all three from their
# registry bases; `make images-local` needs no registry: it makes a Debian bookworm base with
# mmdebstrap (tools/local_base.sh, once: it is kept while it exists), then engine-cpu and
# operator on it. The CUDA engine image needs nvidia/cuda's base, so only `make images` builds
# it. Each build gets the host's pip configuration as a secret and mounts, never as a layer
# (tools/pip_build_config.py), and each image an SBOM next to it under dist/images/
# (tools/image_sbom.sh). One version for all: pyproject's, which `tidegate --version` prints
# and the chart's appVersion repeats (tests/images checks them).
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
IMAGE_REPO ?= ghcr.io/tidegate
IMAGE_TAG ?= $(VERSION)
IMAGE_ENGINE ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)
LOCAL_BASE ?= localhost/tidegate-base:bookworm-py3.11
# runc, cgroupfs and no default ulimits (see the file): what podman needs on hosts like CI's.
# CONTAINERS_CONF= on the command line leaves podman to the machine's own settings.
export CONTAINERS_CONF ?= $(CURDIR)/images/containers.conf
# podman writes OCI images unless told otherwise, and OCI has no HEALTHCHECK: docker's format.
IMAGE_FORMAT = $(if $(filter podman,$(IMAGE_ENGINE)),--format docker)
# The revision goes in as a label of the build as well as a build argument: podman reuses a
# cached LABEL layer whose argument changed, and the image would name an older commit.
REVISION := $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
IMAGE_BUILD = $(IMAGE_ENGINE) build $(IMAGE_FORMAT) --network host \
	--build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) \
	--label org.opencontainers.image.version=$(VERSION) \
	--label org.opencontainers.image.revision=$(REVISION) \
	$$($(PYTHON) tools/pip_build_config.py --engine $(IMAGE_ENGINE) --out .cache/images/pip.conf)
LOCAL_BASE_ARGS = --build-arg PYTHON_IMAGE=$(LOCAL_BASE) --build-arg TCMALLOC_PACKAGE=libtcmalloc-minimal4
# engine-cpu's torch from the host's own index or wheel folder, where its pip has one.
TORCH_ARGS = $(if $(filter engine-cpu,$*),$$($(PYTHON) tools/pip_build_config.py --cpu-torch-index))

.PHONY: images images-local image-engine image-engine-cpu image-operator \
	image-engine-cpu-local image-operator-local local-base

images: image-engine image-engine-cpu image-operator
images-local: image-engine-cpu-local image-operator-local

image-engine image-engine-cpu image-operator: image-%:
	$(IMAGE_BUILD) $(TORCH_ARGS) -f images/$*.Dockerfile -t $(IMAGE_REPO)/$*:$(IMAGE_TAG) .
	tools/image_sbom.sh $(IMAGE_ENGINE) $(IMAGE_REPO)/$*:$(IMAGE_TAG) dist/images

local-base:
	tools/local_base.sh $(IMAGE_ENGINE) $(LOCAL_BASE)

image-engine-cpu-local image-operator-local: image-%-local: local-base
	$(IMAGE_BUILD) $(TORCH_ARGS) $(LOCAL_BASE_ARGS) -f images/$*.Dockerfile -t $(IMAGE_REPO)/$*:$(IMAGE_TAG) .
	tools/image_sbom.sh $(IMAGE_ENGINE) $(IMAGE_REPO)/$*:$(IMAGE_TAG) dist/images
