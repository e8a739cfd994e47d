# syntax=docker/dockerfile:1
# kernel-farm records ingester: `farm ingest` (Redis streams -> PostgreSQL).
# Build from the repository root (see docker/README.md):
#   docker build -f docker/ingester.Dockerfile -t kernel-farm/ingester:0.1.0 .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY farm ./farm
COPY worker ./worker
COPY loader ./loader
# No device here: Redis and PostgreSQL clients only.
RUN pip install ".[cluster,postgres]" \
    && rm -rf /src \
    && python -c "import redis, psycopg, sqlalchemy; print('kernel-farm imports ok')"

RUN groupadd --gid 10001 farm \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/farm --shell /usr/sbin/nologin farm
USER 10001:10001
WORKDIR /home/farm
ENV HOME=/home/farm

ENTRYPOINT ["/usr/bin/tini", "--", "farm", "ingest"]
CMD []
