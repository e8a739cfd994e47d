#!/usr/bin/env bash
# On an NVIDIA GPU host with no network (the workplace's H200 machine): install the wheels
# carried in .whl/ and this project into /tmp/site, unpack the servers carried in .kit/
# (bench/host_kit.sh makes both, here) into /tmp/kit and point FARM_REDIS_BIN and
# FARM_MINIO_BIN at them, point an OpenCL ICD file at NVIDIA's driver, switch the
# drivers' caches off, then run "$@" from the repository root.
#   bench/nvidia_host.sh python3 -m pytest -m gpu tests/test_nvidia.py
#   bench/nvidia_host.sh python3 -m pytest -m gpu -s tests/test_gpu_cluster.py
set -euo pipefail
cd "$(dirname "$0")/.."
# Byte-compiled as pip does by default (the host sets PYTHONDONTWRITEBYTECODE, so a
# module without a .pyc is compiled from source again in every process: 0.3 s of the
# farm's and 0.5 s of pyopencl's and Mako's start-up there, which no installed farm pays).
# Again whenever the carried wheels differ from those installed (a warm host kept
# /tmp/site from a call that carried fewer).
wheels=$(ls .whl | sort | md5sum)
if [ ! -d /tmp/site/pyopencl ] || [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    echo "$wheels" > /tmp/site/.wheels
fi
# The project itself every time: the working tree travels anew with each call. Built
# with the carried setuptools (first on PYTHONPATH): pyproject.toml wants setuptools >= 77.
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --upgrade \
    --target /tmp/site . 2>&1 | grep -v "already exists" || true
# `python3 -m farm` from the repository root imports the working tree's copy: compile it too.
python3 -m compileall -q -j 0 farm worker loader > /dev/null || true
(cd /tmp && python3 -c "import farm.version") || { echo "nvidia_host.sh: the project did not install"; exit 1; }
if [ -d .kit ]; then
    # Python's own lzma and tarfile: the host may lack the xz tool.
    python3 - <<'EOF'
import lzma, os, shutil, tarfile
os.makedirs("/tmp/kit", exist_ok=True)
if os.path.exists(".kit/minio.xz") and not os.path.exists("/tmp/kit/minio"):
    with lzma.open(".kit/minio.xz") as src, open("/tmp/kit/minio.part", "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    os.chmod("/tmp/kit/minio.part", 0o755)
    os.rename("/tmp/kit/minio.part", "/tmp/kit/minio")
if os.path.exists(".kit/redis.tar.xz") and not os.path.exists("/tmp/kit/redis"):
    with tarfile.open(".kit/redis.tar.xz") as tar:
        tar.extractall("/tmp/kit", filter="tar")
EOF
    [ -x /tmp/kit/minio ] && export FARM_MINIO_BIN=/tmp/kit/minio
    [ -x /tmp/kit/redis/redis-server ] && export FARM_REDIS_BIN=/tmp/kit/redis/redis-server
fi
if [ ! -s /etc/OpenCL/vendors/nvidia.icd ]; then
    lib=$(find / -name libnvidia-opencl.so.1 -not -path '/proc/*' 2>/dev/null | head -1 || true)
    mkdir -p /etc/OpenCL/vendors
    echo "$lib" > /etc/OpenCL/vendors/nvidia.icd
fi
export PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1
export FARM_DEVICE="${FARM_DEVICE:-nvidia}" PYTHONUNBUFFERED=1
# Each device's probe build (farm/core/device_probe.py) once, before anything is timed: a
# fresh host has none kept, and the first farm process would pay them (seconds with a
# GPU's context) inside whatever it measures. Kept per fingerprint, later calls read them.
python3 -m farm devices --check || true
"$@"
