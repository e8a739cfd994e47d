#!/usr/bin/env bash
# One call on the H200 host (bench/nvidia_host.sh's set-up; carry .whl and .kit, made by
# bench/host_kit.sh): the GPU-only test and this round's host figures, each step under a
# time limit of its own so that a slow step cannot take the others' time. Logs go to
# $OUT (the device tool's folder) or /tmp/h200-round.
#   bench/h200_round.sh            # about 9 minutes
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/h200-round}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "   rc=$? $(date +%T)"
    tail -n 25 "$out/$name.log"
}
host=bench/nvidia_host.sh
step gpu-test 90 $host python3 -m pytest -m gpu -p no:cacheprovider tests/test_nvidia.py \
    tests/test_programs_gpu.py -k "not reikna and not loopy" -v -s
step control-plane 140 $host python3 bench/bench_control_plane.py --workers 32,128 \
    --chunks 4 --rtt-ms 0.5 --kernels 2000 --clients 2 --latency-rounds 24
step pyapp-nvidia 75 $host python3 bench/bench_pyopencl_app.py --device nvidia --rounds 2
step ready-pocl 95 env FARM_DEVICE=pocl $host python3 bench/bench_ready.py \
    --manifest medium --workers 16 --device pocl --repeat 1 --no-before
step fanout-nvidia 100 $host python3 bench/bench_fanout.py --manifest large --workers 16 \
    --device nvidia --no-loads --repeat 2 --peer-load
step pyapp-pocl 60 env FARM_DEVICE=pocl $host python3 bench/bench_pyopencl_app.py \
    --device pocl --rounds 2
