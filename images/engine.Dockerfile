# syntax=docker/dockerfile:1
# The Tidegate engine on NVIDIA GPUs: PyTorch's CUDA 13.0 build with Triton (the default
# attention backend on CUDA). The operator's default engine image (operator/render.py).
#
#   make image-engine            # = docker/podman build -f images/engine.Dockerfile ...
#   docker run --gpus all -p 8000:8000 -v /models/llama-3-8b:/model:ro \
#       ghcr.io/tidegate/engine:0.1.0              # = tidegate serve --model /model
#
# Built from the repository root (.dockerignore keeps the context to what `pip install`
# reads). The operator's pods run it as uid 10001 with a read-only root filesystem and
# HOME=/tmp (an emptyDir): Triton's kernel cache and compiler scratch files go under /tmp.
#
# CUDA: torch==2.13.0 comes from PyTorch's cu130 wheel index, whose wheels bring their own
# CUDA libraries (nvidia-* wheels) and the matching Triton; the nvidia/cuda base adds the
# NVIDIA container runtime settings and CUDA's forward-compatibility libraries. Hosts need a
# driver for CUDA 13.0 (R580 or newer). For an older driver, pick an index PyTorch publishes
# 2.13.0 on and the base of the same CUDA version, e.g.
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#   --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

ARG CUDA_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONFIG_FILE=/run/secrets/pipconf
# Unpinned apt packages: Ubuntu's archive keeps only the latest build of each, so an exact
# version breaks the build the day a security update lands; the base tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/tidegate
ENV PATH=/opt/tidegate/bin:$PATH
# The host's pip configuration, if any (index, wheel folders, certificate), comes as the
# secret `pipconf` (tools/pip_build_config.py, run by make images): mounted for each pip run of
# this stage, never written to a layer. Without it pip reads no file and uses PyPI.
# The pinned torch wheel first, from the CUDA index named above, so that pyproject's
# `torch>=2.4` is already met and nothing else picks the build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
RUN --mount=type=secret,id=pipconf \
    pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /src
# The dependencies before the sources, so that a change to the code reinstalls only the
# package: the base and engine requirements, read from pyproject.toml.
COPY pyproject.toml ./
RUN --mount=type=secret,id=pipconf \
    python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["engine"]))' > /tmp/requirements.txt \
    && pip install --requirement /tmp/requirements.txt
COPY README.md ./
COPY cli cli
COPY common common
COPY engine engine
COPY operator operator
# The engine extra: everything `tidegate serve` and `tidegate router` import (all installed above).
RUN --mount=type=secret,id=pipconf \
    pip install --no-deps "/src[engine]"

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# The one exception to "no build tools in the final stage": Triton compiles its CUDA driver
# shim (triton/backends/nvidia/driver.c) with the system C compiler, against Python's
# headers, the first time a process launches a kernel, and caches it under $HOME/.triton
# (an emptyDir in a pod, so every new pod compiles it once). Without gcc, libc6-dev and
# python3.12-dev the triton attention backend fails at its first step.
# The pods run as 10001:10001, a uid no user of the node has; unpinned apt packages: see the
# comment on the build stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-dev gcc libc6-dev \
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
HEALTHCHECK --interval=30s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["tidegate"]
CMD ["serve", "--model", "/model"]
# Last, so that a new revision or version changes this layer's metadata and rebuilds
# nothing above it.
ARG CUDA_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tidegate-engine" \
      org.opencontainers.image.description="Tidegate inference engine (tidegate serve), PyTorch CUDA 13.0 build with Triton" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="https://github.com/tidegate/tidegate" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${CUDA_IMAGE}"
