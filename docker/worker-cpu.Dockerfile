# syntax=docker/dockerfile:1
# kernel-farm compile worker on the CPU: PoCL through pyopencl, Debian's (pocl-opencl-icd,
# PoCL 3.1 with LLVM 15) beside the wheel's (pocl-binary-distribution, 3.0 with LLVM 14).
# Build from the repository root (see docker/README.md):
#   docker build -f docker/worker-cpu.Dockerfile -t kernel-farm/worker-cpu:0.1.0 .
#
# Two stages: `build` installs the locked dependencies (docker/requirements/worker-cpu.lock,
# every file's SHA-256 checked) and then the project into a virtualenv; the final stage
# copies only that virtualenv, so no pip cache, build tool or source tree ships.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/farm
ENV PATH=/opt/farm/bin:$PATH
# Dependencies before the source: a change of the code rebuilds only the layers below.
COPY docker/requirements/worker-cpu.lock /tmp/requirements.lock
RUN pip install --no-deps --require-hashes -r /tmp/requirements.lock
WORKDIR /src
COPY pyproject.toml README.md ./
COPY farm ./farm
COPY worker ./worker
COPY loader ./loader
# The project alone: its dependencies and build backend are already there (the lock).
RUN pip install --no-deps --no-build-isolation . \
    && pip check \
    && python -c "import farm.cli.main, worker.app, loader, pyopencl, celery, minio, psycopg" \
    && python -c "import pyopencl as cl; assert cl.get_platforms(), 'no OpenCL platform'"

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/farm/bin:$PATH
# tini: PID 1 that forwards SIGTERM to the worker (Celery warm shutdown) and reaps.
# gcc (binutils, libgcc) and libc6-dev: PoCL links every kernel it compiles with the
# system `ld` against -lgcc -lgcc_s -lc; without them every compile aborts its process.
# pocl-opencl-icd: the wheel's PoCL compiles nothing on CPUs newer than its LLVM 14 (AMD
# Zen 5); the worker serves the newest PoCL whose probe build works (docs/DESIGN.md,
# "Which device").
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini gcc libc6-dev pocl-opencl-icd \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/farm /opt/farm
# A non-root user with a fixed uid (the chart's runAsUser).
RUN groupadd --gid 10001 farm \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/farm --shell /usr/sbin/nologin farm
USER 10001:10001
WORKDIR /home/farm
ENV HOME=/home/farm

ENTRYPOINT ["/usr/bin/tini", "--", "farm", "worker"]
CMD []
