# syntax=docker/dockerfile:1
# The Tidegate engine on CPU: PyTorch's CPU build, no CUDA. The image the tiny examples use
# (examples/unified-tiny.yaml) and the one for clusters without accelerators.
#
#   docker build -f images/engine-cpu.Dockerfile -t ghcr.io/tidegate/engine-cpu:0.1.0 .
#   docker run -p 8000:8000 -v "$PWD/.cache/models/tiny-llama:/model:ro" \
#       ghcr.io/tidegate/engine-cpu:0.1.0          # = tidegate serve --model /model
#
# Built from the repository root (.dockerignore keeps the context to what `pip install`
# reads). The operator's pods run it as uid 10001 with a read-only root filesystem and
# HOME=/tmp (an emptyDir): the image writes nothing outside /tmp at run time, and its files
# are root's, readable by everyone.

ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tidegate
ENV PATH=/opt/tidegate/bin:$PATH
# The pinned torch wheel first, from PyTorch's CPU index: PyPI's Linux torch is the CUDA
# build (gigabytes of nvidia-* wheels), which pyproject's `torch>=2.4` would otherwise take.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli cli
COPY common common
COPY engine engine
COPY operator operator
# The engine extra: everything `tidegate serve` and `tidegate router` import.
RUN pip install "/src[engine]"

FROM ${PYTHON_IMAGE}
ARG PYTHON_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tidegate-engine-cpu" \
      org.opencontainers.image.description="Tidegate inference engine (tidegate serve), PyTorch CPU build" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="https://github.com/tidegate/tidegate" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"
# uid/gid 10001: the pods the operator renders run as 10001:10001 (runAsUser, fsGroup), a
# uid no user of the node has.
# The one exception to "no build tools in the final stage": on CPU the engine compiles C++
# at run time, inductor's generated kernels (compilation level 1, the CPU default) and the
# paged-attention kernel (engine/attention/paged_attention.cpp), each cached under $HOME.
# Without g++ both fall back: eager mode and the slower torch attention backend.
# tcmalloc (libtcmalloc-minimal4t64, trixie's name for libtcmalloc-minimal4): the engine
# spawns its engine core on it when present (--cpu-allocator auto; engine/allocator.py).
# Unpinned apt packages: Debian's archive keeps only the latest build of each.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libc6-dev libtcmalloc-minimal4t64 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 tidegate \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin tidegate
COPY --from=build /opt/tidegate /opt/tidegate
ENV PATH=/opt/tidegate/bin:$PATH \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 10001:10001
# 8000: the OpenAI-compatible API (and /health, /metrics); 14579: KV transfer of prefill pods.
EXPOSE 8000 14579
# Docker's own check (Kubernetes uses the probes the operator renders). /health answers once
# the weights are loaded, hence the long start period. No curl in the image: Python's urllib.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["tidegate"]
CMD ["serve", "--model", "/model"]
