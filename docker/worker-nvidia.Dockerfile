# syntax=docker/dockerfile:1
# kernel-farm compile worker on NVIDIA GPUs: NVIDIA's OpenCL through the driver that the
# NVIDIA container toolkit mounts into the container (libnvidia-opencl.so.1).
# Build from the repository root (see docker/README.md):
#   docker build -f docker/worker-nvidia.Dockerfile -t kernel-farm/worker-nvidia:0.1.0 .
# Ubuntu 24.04: its python3 (3.12) meets the package's >=3.11.
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# NVIDIA_DRIVER_CAPABILITIES: compute mounts the driver's CUDA and OpenCL libraries
# (libnvidia-opencl.so.1), utility mounts nvidia-smi. Which GPUs the container sees is
# left to the device plugin (the pod's nvidia.com/gpu request).
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv tini ocl-icd-libopencl1 \
    && rm -rf /var/lib/apt/lists/*

# The ICD registry entry: the OpenCL loader dlopens the driver's library named here.
RUN mkdir -p /etc/OpenCL/vendors \
    && echo "libnvidia-opencl.so.1" > /etc/OpenCL/vendors/nvidia.icd

# A virtualenv (Ubuntu's Python is externally managed, PEP 668).
RUN python3 -m venv /opt/farm
ENV PATH=/opt/farm/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY farm ./farm
COPY worker ./worker
COPY loader ./loader
# No PoCL extra: the GPU is the device here. (pyopencl's wheel still ships a PoCL CPU
# device, so an NVIDIA pool names its fingerprint: the chart requires it.)
RUN pip install ".[cluster,postgres]" \
    && rm -rf /src \
    && python -c "import pyopencl, celery, minio, psycopg; print('kernel-farm imports ok')"

RUN groupadd --gid 10001 farm \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/farm --shell /usr/sbin/nologin farm
USER 10001:10001
WORKDIR /home/farm
ENV HOME=/home/farm

ENTRYPOINT ["/usr/bin/tini", "--", "farm", "worker"]
CMD []
