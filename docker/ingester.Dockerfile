# syntax=docker/dockerfile:1
# kernel-farm records ingester: `farm ingest` (Redis streams -> PostgreSQL).
# Build from the repository root (see docker/README.md):
#   docker build -f docker/ingester.Dockerfile -t kernel-farm/ingester:0.1.0 .
#
# No device library: docker/requirements/ingester.lock holds the cluster and postgres
# extras only (no pyopencl, no PoCL), checked by SHA-256. Two stages as in the workers.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/farm
ENV PATH=/opt/farm/bin:$PATH
COPY docker/requirements/ingester.lock /tmp/requirements.lock
RUN pip install --no-deps --require-hashes -r /tmp/requirements.lock
WORKDIR /src
COPY pyproject.toml README.md ./
COPY farm ./farm
COPY worker ./worker
COPY loader ./loader
RUN pip install --no-deps --no-build-isolation . \
    && pip check \
    && python -c "import farm.cli.main, farm.records.ingest, redis, psycopg, sqlalchemy" \
    && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('pyopencl') is not None)"

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/farm/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/farm /opt/farm
RUN groupadd --gid 10001 farm \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/farm --shell /usr/sbin/nologin farm
USER 10001:10001
WORKDIR /home/farm
ENV HOME=/home/farm

ENTRYPOINT ["/usr/bin/tini", "--", "farm", "ingest"]
CMD []
