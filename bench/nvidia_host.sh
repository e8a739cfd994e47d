#!/usr/bin/env bash
# On an NVIDIA GPU host with no network (the workplace's H200 machine): install the wheels
# carried in .whl/ and this project into /tmp/site, point an OpenCL ICD file at NVIDIA's
# driver, switch the drivers' caches off, then run "$@" from the repository root.
#   bench/nvidia_host.sh python3 -m pytest -m gpu tests/test_nvidia.py
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -d /tmp/site/pyopencl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
fi
# The project itself every time: the working tree travels anew with each call.
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade \
    --target /tmp/site . 2>&1 | grep -v "already exists" || true
export PYTHONPATH=/tmp/site
if [ ! -s /etc/OpenCL/vendors/nvidia.icd ]; then
    lib=$(find / -name libnvidia-opencl.so.1 -not -path '/proc/*' 2>/dev/null | head -1 || true)
    mkdir -p /etc/OpenCL/vendors
    echo "$lib" > /etc/OpenCL/vendors/nvidia.icd
fi
export PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1
export FARM_DEVICE="${FARM_DEVICE:-nvidia}" PYTHONUNBUFFERED=1
"$@"
