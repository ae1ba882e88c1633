# syntax=docker/dockerfile:1
# One image runs both tiers; only the arguments differ:
#   tandem serve prefill --model ... --port 50052
#   tandem serve decode  --model ... --port 50051 --prefill dns:///...
#
# CPU (default):
#   docker build -t tandem:0.1.0 .
# CUDA: a base image that already ships CUDA torch; its torch is kept (the venv sees the
# base's site-packages), so no CPU wheel replaces it:
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime -t tandem:0.1.0-cuda .
# The base must provide Python >= 3.10 as `python3`.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- builder: resolves and installs everything into a self-contained virtualenv ----
FROM ${BASE_IMAGE} AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/tandem/bin:$PATH
SHELL ["/bin/sh", "-eu", "-c"]
RUN python3 -m venv --system-site-packages /opt/tandem
# Pinned CPU wheel unless the base image brings torch: plain PyPI would pull a CUDA build.
RUN python -c "import torch" 2>/dev/null \
    || pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md requirements-lock.txt ./
COPY base ./base
COPY tandem ./tandem
COPY engine ./engine
COPY kernels ./kernels
COPY kv_transfer ./kv_transfer
COPY prefill_service ./prefill_service
COPY decode_service ./decode_service
COPY serving ./serving
COPY protos ./protos
COPY bench ./bench
# A regular (non-editable) install: the runtime stage gets no source tree. The smoke check serves:
# both tiers start on a tiny random model, answer over gRPC and HTTP and stop cleanly, so a runtime
# dependency that `pip install .` does not bring fails the build, not every release.
# Every dependency at the version `make test` passed with (requirements-lock.txt); a base image's own torch
# (CUDA builds bring triton; the CPU wheel does not) keeps its version and the triton it was built with.
# PIP_CONSTRAINT, unlike --constraint, also pins the build backend in pip's isolated build environment.
# The tracing extra (OpenTelemetry's SDK and OTLP exporter) makes the chart's tracing value work; it is
# imported only when a tier is started with an OTLP endpoint.
RUN { python -c "import triton" 2>/dev/null && grep -v -E '^(torch|triton)==' requirements-lock.txt \
        || cat requirements-lock.txt; } \
        > /tmp/constraints.txt \
    && PIP_CONSTRAINT=/tmp/constraints.txt pip install --no-cache-dir "./[tracing]" \
    && tandem selftest

# ---- runtime: the virtualenv and an unprivileged user, nothing else ----
FROM ${BASE_IMAGE} AS runtime
LABEL org.opencontainers.image.title="tandem" \
      org.opencontainers.image.description="Disaggregated LLM serving: prefill and decode tiers over gRPC" \
      org.opencontainers.image.licenses="Apache-2.0"
# Fixed ids so that Kubernetes' runAsUser / fsGroup (10001) match the image's owner.
RUN groupadd --system --gid 10001 tandem \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/tandem --create-home \
       --shell /usr/sbin/nologin tandem \
    && mkdir -p /var/lib/tandem \
    && chown 10001:10001 /var/lib/tandem
COPY --from=builder /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH \
    TANDEM_HOME=/var/lib/tandem \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/tandem
USER 10001:10001
# decode gRPC, prefill gRPC, decode metrics, prefill metrics
EXPOSE 50051 50052 9400 9401
# No HEALTHCHECK: Kubernetes probes grpc.health.v1 natively.
ENTRYPOINT ["tandem"]
CMD ["--help"]
