# syntax=docker/dockerfile:1
# The Tidegate operator: `tidegate operator` (kopf), and `tidegate plan`. No torch: the
# operator reaches the engine only through tidegate.engine.config (pydantic), so the package
# goes in with its operator extra and without the engine extra.
#
#   make image-operator          # or make images-local: on a Debian base made here, no registry
#   docker run -v "$HOME/.kube:/tmp/.kube:ro" ghcr.io/tidegate/operator:0.1.0
#
# Built from the repository root (.dockerignore keeps the context to what `pip install`
# reads). Runs as uid 65532 with HOME=/tmp and writes nothing at run time, so a read-only
# root filesystem suits it.

ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

FROM ${PYTHON_IMAGE} AS build
# The host's pip configuration, if any, comes as the secret `pipconf`: see engine-cpu.Dockerfile.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONFIG_FILE=/run/secrets/pipconf
# python3, not python: Debian's own Python (the local base, make images-local) has no `python`.
RUN python3 -m venv /opt/tidegate
ENV PATH=/opt/tidegate/bin:$PATH
WORKDIR /src
# The dependencies before the sources, so that a change to the code reinstalls only the
# package: the base and operator requirements, read from pyproject.toml.
COPY pyproject.toml ./
RUN --mount=type=secret,id=pipconf \
    python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["operator"]))' > /tmp/requirements.txt \
    && pip install --requirement /tmp/requirements.txt
COPY README.md ./
COPY cli cli
COPY common common
COPY engine engine
COPY operator operator
# The base install (pydantic, pyyaml) and the operator extra (kopf, aiohttp). Leaving out the
# engine extra (torch, numpy, fastapi, ...) saves gigabytes; tests/images checks that nothing
# the operator's code path imports is missing, and that the built image has no torch.
RUN --mount=type=secret,id=pipconf \
    pip install --no-deps "/src[operator]"

FROM ${PYTHON_IMAGE}
# 65532: the ids the chart runs the operator as (charts/tidegate values.yaml, securityContext).
RUN groupadd --gid 65532 tidegate \
    && useradd --uid 65532 --gid 65532 --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin tidegate
COPY --from=build /opt/tidegate /opt/tidegate
ENV PATH=/opt/tidegate/bin:$PATH \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 65532:65532
# kopf's liveness endpoint (tidegate operator --liveness, default http://0.0.0.0:8080/healthz).
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["tidegate"]
CMD ["operator"]
# Last, so that a new revision or version changes this layer's metadata and rebuilds
# nothing above it.
ARG PYTHON_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tidegate-operator" \
      org.opencontainers.image.description="Tidegate Kubernetes operator (kopf) for LLMDeployment resources" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="https://github.com/tidegate/tidegate" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"
