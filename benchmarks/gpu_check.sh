#!/usr/bin/env bash
# The GPU checks of the engine, as one prepared run for a lent machine (an H100 or H200 with
# CUDA, PyTorch and Triton installed, no network), in about 8 minutes:
#   1. the Triton kernels on the GPU, not in the interpreter: paged attention, LoRA, and
#      LoRA inside captured CUDA graphs, and FP8 products with group scales
#      (tests/engine/test_triton_attention.py, tests/engine/test_lora_triton.py,
#      tests/engine/test_fp8_triton.py);
#   2. benchmarks/cuda_graphs.py at levels 0 and 2 (eager, then compiled with decode
#      graphs), synchronous and with async scheduling: float32 greedy parity with a
#      synchronous eager engine, then the decode step time at batch 1-128;
#   3. the serving benchmark on the GPU (the small model at its CUDA defaults: level 2, the
#      triton backend), synchronous against async scheduling, one run each at 4 req/s and at
#      full load (vLLM's GPU build cannot be carried there, so no peer);
#   4. benchmarks/fp8_weights.py in bf16: FP8 weights' memory, decode speed and agreement
#      against the bf16 weights, with real FP8 products (one repeat).
# Everything it writes goes to $OUT (the device tool's folder), else benchmarks/results/gpu.
#
# The machine's image lacks some of the engine's dependencies. Before the run, here:
#     bash benchmarks/gpu_check.sh --fetch-wheels    # wheels for Python 3.12 into .whl/
# then on the device, with `.whl` carried:
#     bash benchmarks/gpu_check.sh
# The wheels are the versions this checkout's .venv runs (the test suite's), the rest (torch,
# triton, numpy, tokenizers, transformers, ...) the image's own.
set -euo pipefail
cd "$(dirname "$0")/.."

# Engine dependencies missing from the device image (KINDS.md of the device tool lists what is
# there), and what they need that is missing too.
WHEELS=(pydantic pydantic_core annotated-types typing-inspection typing_extensions msgspec
    pyzmq fastapi opentelemetry-api starlette uvicorn setproctitle llguidance sniffio)
PYTHON_VERSION=${PYTHON_VERSION:-3.12}

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    rm -rf .whl && mkdir -p .whl  # ignored (.gitignore): the device tool's `carry` takes it
    specs=$(.venv/bin/python - "${WHEELS[@]}" <<'EOF'
import importlib.metadata
import sys

print(" ".join(f"{name}=={importlib.metadata.version(name)}" for name in sys.argv[1:]))
EOF
)
    platforms=()
    for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    # shellcheck disable=SC2086 # one argument per spec
    .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
        --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl $specs
    ls .whl
    du -sh .whl
    exit 0
fi

OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
SITE=/tmp/tidegate-site
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
# tidegate itself: its packages are this checkout's folders (pyproject.toml's package-dir).
mkdir -p "$SITE/tidegate"
for package in cli common engine operator; do ln -sfn "$PWD/$package" "$SITE/tidegate/$package"; done
export PYTHONPATH="$SITE:$PWD"
nvidia-smi -L | tee "$OUT/device.txt"
"$PY" - <<'EOF' | tee -a "$OUT/device.txt"
import torch
import triton

import tidegate.engine.entrypoints.openai.api_server  # noqa: F401 (the server's imports resolve)

assert torch.cuda.is_available(), "no CUDA device"
print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
EOF

echo "== 1. kernels on the GPU"
"$PY" -m pytest -q -p no:cacheprovider -p no:schemathesis tests/engine/test_triton_attention.py \
    tests/engine/test_lora_triton.py tests/engine/test_fp8_triton.py 2>&1 | tee "$OUT/kernels.log"

echo "== 2. CUDA graphs, synchronous then async scheduling"
"$PY" benchmarks/cuda_graphs.py --levels 0 2 --out "$OUT/cuda_graphs.json" >/dev/null
"$PY" benchmarks/cuda_graphs.py --levels 0 2 --async-scheduling \
    --out "$OUT/cuda_graphs_async.json" >/dev/null

echo "== 3. serving on the GPU, synchronous against async scheduling"
"$PY" benchmarks/serving_vs_vllm.py --servers tidegate,tidegate-async --repeats 1 \
    --rates 4,inf --out-dir "$OUT" --readme "$OUT/README.md"

echo "== 4. FP8 weights against bf16"
"$PY" benchmarks/fp8_weights.py --dtype bfloat16 --repeats 1 --batch-sizes 1 32 \
    --out "$OUT/fp8_weights.json"
