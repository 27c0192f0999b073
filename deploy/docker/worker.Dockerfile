# syntax=docker/dockerfile:1
# An elastrain worker: what TorchX starts in each node pod (torchrun ... -m worker). CPU torch by
# default; for CUDA pass a CUDA base and the matching torch wheel index:
#
#   docker build -f deploy/docker/worker.Dockerfile -t elastrain/worker:0.1.0 .
#   docker build -f deploy/docker/worker.Dockerfile -t elastrain/worker:0.1.0-cu126 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .
#
# A base without python3 (the CUDA ones) gets the distribution's python3 and venv.
# The runtime user has the service image's ids (10001) so both can write the checkpoint volume.
ARG BASE_IMAGE=python:3.11.11-slim-bookworm

FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN if ! command -v python3 >/dev/null 2>&1; then \
      apt-get update \
      && apt-get install -y --no-install-recommends python3 python3-venv \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/elastrain \
    && /opt/elastrain/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY worker ./worker
# torch is already satisfied from the index above, so pip keeps that build.
RUN /opt/elastrain/bin/pip install . && rm -rf /src \
    && groupadd --system --gid 10001 elastrain \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin elastrain \
    && mkdir -p /checkpoints && chown 10001:10001 /checkpoints
ENV PATH=/opt/elastrain/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
WORKDIR /tmp
USER 10001:10001
EXPOSE 9400 29500
CMD ["python", "-m", "worker", "--help"]
