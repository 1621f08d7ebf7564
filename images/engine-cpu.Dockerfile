# syntax=docker/dockerfile:1
# The Tidegate engine on CPU: PyTorch's CPU build, no CUDA. The image the tiny examples use
# (examples/unified-tiny.yaml) and the one for clusters without accelerators.
#
#   make image-engine-cpu        # or make images-local: on a Debian base made here, no registry
#   docker run -p 8000:8000 -v "$PWD/.cache/models/tiny-llama:/model:ro" \
#       ghcr.io/tidegate/engine-cpu:0.1.0          # = tidegate serve --model /model
#
# make passes the version, the git revision and the host's pip configuration (a secret); a
# plain `docker build -f images/engine-cpu.Dockerfile .` works too, against PyPI
# (docs/install.md).
#
# Built from the repository root (.dockerignore keeps the context to what `pip install`
# reads). The operator's pods run it as uid 10001 with a read-only root filesystem and
# HOME=/tmp (an emptyDir): the image writes nothing outside /tmp at run time, and its files
# are root's, readable by everyone.

ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

FROM ${PYTHON_IMAGE} AS build
# The host's pip configuration, if any (index, wheel folders, certificate), comes as the
# secret `pipconf` (tools/pip_build_config.py, run by make images): mounted for each pip run of
# this stage, never written to a layer. Without it pip reads no file and uses PyPI.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONFIG_FILE=/run/secrets/pipconf
# python3, not python: Debian's own Python (the local base, make images-local) has no `python`.
RUN python3 -m venv /opt/tidegate
ENV PATH=/opt/tidegate/bin:$PATH
# The pinned torch wheel first, from PyTorch's CPU index: PyPI's Linux torch is the CUDA
# build (gigabytes of nvidia-* wheels), which pyproject's `torch>=2.4` would otherwise take.
# A host whose pip has an index or wheel folder of its own passes its index instead (make
# images, tools/pip_build_config.py): its wheel folders and extra indexes still count.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
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

FROM ${PYTHON_IMAGE}
# uid/gid 10001: the pods the operator renders run as 10001:10001 (runAsUser, fsGroup), a
# uid no user of the node has.
# The one exception to "no build tools in the final stage": on CPU the engine compiles C++
# at run time, inductor's generated kernels (compilation level 1, the CPU default; built as
# Python extensions, against the base's Python headers) and the paged-attention kernel
# (engine/attention/paged_attention.cpp), each cached under $HOME. Without g++ both fall
# back: eager mode and the slower torch attention backend.
# tcmalloc: the engine spawns its engine core on it when present (--cpu-allocator auto;
# engine/allocator.py). Its package is libtcmalloc-minimal4t64 in trixie (python:*-slim-trixie)
# and libtcmalloc-minimal4 in bookworm (the local base): an argument.
ARG TCMALLOC_PACKAGE=libtcmalloc-minimal4t64
# Unpinned apt packages: Debian's archive keeps only the latest build of each.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libc6-dev "${TCMALLOC_PACKAGE}" \
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
# Last, so that a new revision or version changes this layer's metadata and rebuilds
# nothing above it.
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
