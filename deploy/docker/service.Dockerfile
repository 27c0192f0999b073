# syntax=docker/dockerfile:1
# The elastrain control plane: `elastrain serve`. No torch in this image (the service never imports
# it); the package is installed with --no-deps on top of service-requirements.txt.
#
#   docker build -f deploy/docker/service.Dockerfile -t elastrain/service:0.1.0 .
#
# PYTHON_IMAGE is pinned to a patch release; pin it further by digest in your registry mirror
# (--build-arg PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:...).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/elastrain
COPY deploy/docker/service-requirements.txt /tmp/service-requirements.txt
RUN /opt/elastrain/bin/pip install -r /tmp/service-requirements.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY worker ./worker
RUN /opt/elastrain/bin/pip install --no-deps . \
    && if /opt/elastrain/bin/python -c "import torch" 2>/dev/null; then \
         echo "torch must not be in the service image" >&2; exit 1; fi

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 elastrain \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin elastrain \
    && mkdir -p /var/lib/elastrain /checkpoints \
    && chown 10001:10001 /var/lib/elastrain /checkpoints
COPY --from=build /opt/elastrain /opt/elastrain
ENV PATH=/opt/elastrain/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    ELASTRAIN_DATA_DIR=/var/lib/elastrain
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["elastrain"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]
