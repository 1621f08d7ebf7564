# syntax=docker/dockerfile:1
# The Tidegate operator: `tidegate operator` (kopf), and `tidegate plan`. No torch: the
# operator reaches the engine only through tidegate.engine.config (pydantic), so the package
# goes in with its operator extra and without the engine extra.
#
#   docker build -f images/operator.Dockerfile -t ghcr.io/tidegate/operator:0.1.0 .
#   docker run -v "$HOME/.kube:/tmp/.kube:ro" ghcr.io/tidegate/operator:0.1.0
#
# Built from the repository root (.dockerignore keeps the context to what `pip install`
# reads). Runs as uid 65532 with HOME=/tmp and writes nothing at run time, so a read-only
# root filesystem suits it.

ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tidegate
ENV PATH=/opt/tidegate/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli cli
COPY common common
COPY engine engine
COPY operator operator
# The base install (pydantic, pyyaml) and the operator extra (kopf, aiohttp). Leaving out the
# engine extra (torch, numpy, fastapi, ...) saves gigabytes; tests/images checks that nothing
# the operator's code path imports is missing.
RUN pip install "/src[operator]"

FROM ${PYTHON_IMAGE}
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
