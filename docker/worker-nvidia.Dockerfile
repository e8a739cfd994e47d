# syntax=docker/dockerfile:1
# kernel-farm compile worker on NVIDIA GPUs: NVIDIA's OpenCL through the driver that the
# NVIDIA container toolkit mounts into the container (libnvidia-opencl.so.1).
# Build from the repository root (see docker/README.md):
#   docker build -f docker/worker-nvidia.Dockerfile -t kernel-farm/worker-nvidia:0.1.0 .
#
# One Python across the images: the virtualenv is built on the same python:3.11 image
# as the others (same lock, same interpreter), and the final stage is NVIDIA's `-base-`
# CUDA image (CUDA's minimum: the driver brings OpenCL, nothing of the CUDA runtime
# or toolkit is used) with that interpreter copied in.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/farm
ENV PATH=/opt/farm/bin:$PATH
# No PoCL (the GPU is the device): worker-nvidia.lock is worker-cpu.lock without it.
COPY docker/requirements/worker-nvidia.lock /tmp/requirements.lock
RUN pip install --no-deps --require-hashes -r /tmp/requirements.lock
WORKDIR /src
COPY pyproject.toml README.md ./
COPY farm ./farm
COPY worker ./worker
COPY loader ./loader
RUN pip install --no-deps --no-build-isolation . \
    && pip check \
    && python -c "import farm.cli.main, worker.app, loader, pyopencl, celery, minio, psycopg"

FROM ${CUDA_IMAGE}
# NVIDIA_DRIVER_CAPABILITIES: compute mounts the driver's CUDA and OpenCL libraries
# (libnvidia-opencl.so.1), utility mounts nvidia-smi. Which GPUs the container sees is
# left to the device plugin (the pod's nvidia.com/gpu request).
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PATH=/opt/farm/bin:/usr/local/bin:$PATH
# tini; the OpenCL ICD loader; the shared libraries the python:3.11 interpreter's
# modules link (ssl, sqlite3, ctypes, lzma, bz2, zlib, expat, uuid, readline).
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini ocl-icd-libopencl1 ca-certificates \
        libssl3t64 libsqlite3-0 libffi8 liblzma5 libbz2-1.0 zlib1g libexpat1 libuuid1 \
        libreadline8t64 \
    && rm -rf /var/lib/apt/lists/*
# The ICD registry entry: the OpenCL loader dlopens the driver's library named here.
RUN mkdir -p /etc/OpenCL/vendors \
    && echo "libnvidia-opencl.so.1" > /etc/OpenCL/vendors/nvidia.icd
COPY --from=build /usr/local /usr/local
COPY --from=build /opt/farm /opt/farm
# ldconfig: libpython3.11.so is in /usr/local/lib, which Ubuntu's ld.so.conf lists.
RUN ldconfig \
    && python -c "import ssl, sqlite3, ctypes, lzma, bz2, zlib, uuid, farm.cli.main, pyopencl" \
    && groupadd --gid 10001 farm \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/farm --shell /usr/sbin/nologin farm
USER 10001:10001
WORKDIR /home/farm
ENV HOME=/home/farm

ENTRYPOINT ["/usr/bin/tini", "--", "farm", "worker"]
CMD []
