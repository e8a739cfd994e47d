# syntax=docker/dockerfile:1
# kernel-farm compile worker on the CPU: PoCL (pocl-binary-distribution) through pyopencl.
# Build from the repository root (see docker/README.md):
#   docker build -f docker/worker-cpu.Dockerfile -t kernel-farm/worker-cpu:0.1.0 .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# tini: PID 1 that forwards SIGTERM to the worker (Celery warm shutdown) and reaps.
# gcc (binutils, libgcc) and libc6-dev: PoCL links every kernel it compiles with the
# system `ld` against -lgcc -lgcc_s -lc; without them every compile aborts its process.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY farm ./farm
COPY worker ./worker
COPY loader ./loader
# Every extra: pocl (pocl-binary-distribution), cluster (Celery, Redis, MinIO), postgres.
RUN pip install ".[all]" \
    && rm -rf /src \
    && python -c "import pyopencl, celery, minio, psycopg; print('kernel-farm imports ok')"

# A non-root user with a fixed uid (the chart's runAsUser).
RUN groupadd --gid 10001 farm \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/farm --shell /usr/sbin/nologin farm
USER 10001:10001
WORKDIR /home/farm
ENV HOME=/home/farm

ENTRYPOINT ["/usr/bin/tini", "--", "farm", "worker"]
CMD []
