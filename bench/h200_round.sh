#!/usr/bin/env bash
# The H200 host's figures, one device call per group of steps (bench/nvidia_host.sh's
# set-up; carry .whl and .kit, made by bench/host_kit.sh). Each step runs under a time
# limit of its own so that a slow step cannot take the others' time, and writes its log
# to $OUT (the device tool's folder, which comes back even when the call runs out of
# time) or /tmp/h200-round; each step's last lines are printed as it ends.
#   bench/h200_round.sh probe-served pyapp-nvidia pyapp-pocl  # about 6 minutes (issue 30)
#   bench/h200_round.sh pyapp-30m                             # at most 5 minutes (issue 30
#       merged with 29: the quick path under the trust rule, proving ahead; NVIDIA 2
#       rounds, then PoCL 5 one round)
#   bench/h200_round.sh gpu-test pyapp-nvidia ready-pocl      # about 9 minutes
#   bench/h200_round.sh fanout-nvidia pyapp-pocl              # about 9 minutes
#   bench/h200_round.sh control-plane                         # about 4 minutes
#   bench/h200_round.sh ready-speed-pocl gpu-cluster-bench    # not run yet (next session)
#   bench/h200_round.sh proofs-nvidia proofs-pocl trust-pocl  # about 9 minutes (issue 29)
#   bench/h200_round.sh tune-nvidia                           # about 5 minutes (issue 28)
#   bench/h200_round.sh tune-pocl-noise                       # about 2 minutes (optional)
#   bench/h200_round.sh control-plane-31                      # about 3 minutes (issue 31:
#       this tree beside 624c62d and a bare Celery round trip; carry .base too)
#   bench/h200_round.sh control-plane-31-128                  # a machine of 32+ cores
#   bench/h200_round.sh control-plane-ab                      # about 5 minutes: this tree
#       against .base/ab (carry .base)
#   bench/h200_round.sh pyapp-ab                              # about 6 minutes (issue 30:
#       this tree against .base/ab on NVIDIA; carry .whl with the applications' wheels,
#       .kit, .base)
#   bench/h200_round.sh capture-pocl                          # about 4 minutes (issue 30)
#   bench/h200_round.sh gpu-test pyapp-final                  # at most 7.5 minutes: the
#       GPU tests, the three applications on NVIDIA (2 rounds), then on PoCL 5 (1 round,
#       with the capture-prepared node)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/h200-round}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
host=bench/nvidia_host.sh
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s) $(date +%T)"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "   rc=$? $(date +%T)"
    tail -n 20 "$out/$name.log"
}
[ $# -gt 0 ] || set -- gpu-test pyapp-nvidia ready-pocl
for name in "$@"; do
    case "$name" in
        gpu-test) step gpu-test 120 $host python3 -m pytest -m gpu -p no:cacheprovider \
            tests/test_nvidia.py tests/test_programs_gpu.py -v -s ;;
        fanout-nvidia) step fanout-nvidia 320 $host python3 bench/bench_fanout.py \
            --manifest large --workers 16 --device nvidia --no-loads --repeat 4 --peer-load ;;
        pyapp-nvidia) step pyapp-nvidia 240 $host python3 bench/bench_pyopencl_app.py \
            --device nvidia --rounds 3 ;;
        probe-served) step probe-served 120 $host python3 bench/probe_served_start.py \
            --device nvidia ;;
        # which driver cache makes the prover's context slow, and what a Python start-up
        # costs there (plain, -I, -S, the farm's launcher on `python -c pass`)
        prover-context) step prover-context 180 $host sh -c \
            'python3 bench/probe_prover_context.py --device nvidia --rounds 3;
             python3 bench/probe_prover_context.py --device pocl --rounds 2;
             for f in "" -I -S; do python3 -c "import subprocess,sys,time,statistics as s
t=[]
for i in range(7):
    a=time.perf_counter(); subprocess.run(sys.argv[1:]); t.append(time.perf_counter()-a)
print(\"start-up\", sys.argv[1:], round(1000*s.median(t),1), \"ms\")" python3 $f -c pass; done;
             python3 -X importtime -c pass 2>&1 | sort -t"|" -k2 -n | tail -6' ;;
        ready-pocl) step ready-pocl 240 env FARM_DEVICE=pocl $host python3 bench/bench_ready.py \
            --manifest medium --workers 16 --device pocl --repeat 1 --no-before ;;
        # issue 30 after issue 29 (i30m): the three applications, a signed store, on NVIDIA
        # (2 rounds) then PoCL 5 (1 round), one device call; each part bounded so both fit
        pyapp-30m) step pyapp-30m 300 $host sh -c \
            'timeout 170 python3 bench/bench_pyopencl_app.py --device nvidia --rounds 2;
             FARM_DEVICE=pocl timeout 110 python3 bench/bench_pyopencl_app.py --device pocl \
                 --rounds 1' ;;
        pyapp-final) step pyapp-final 320 $host sh -c \
            'timeout 170 python3 bench/bench_pyopencl_app.py --device nvidia --rounds 2;
             FARM_DEVICE=pocl timeout 140 python3 bench/bench_pyopencl_app.py --device pocl \
                 --rounds 1 --capture-row' ;;
        # issue 30 on NVIDIA, this tree against the commit exported in .base/ab, the two
        # alternating in one call (array and reikna, one round each, twice)
        pyapp-ab) step pyapp-ab 560 $host sh -c \
            'for i in 1 2; do
                 PYTHONPATH=.base/ab:$PYTHONPATH timeout 130 python3 .base/ab/bench/bench_pyopencl_app.py \
                     --device nvidia --rounds 1 --apps array,reikna | grep -v "^BENCH" | sed "s/^/ab: /";
                 timeout 130 python3 bench/bench_pyopencl_app.py --device nvidia --rounds 1 \
                     --apps array,reikna | grep -v "^BENCH" | sed "s/^/new: /";
             done' ;;
        pyapp-pocl) step pyapp-pocl 300 env FARM_DEVICE=pocl $host python3 \
            bench/bench_pyopencl_app.py --device pocl --rounds 2 ;;
        gpu-cluster-bench) step gpu-cluster-bench 560 $host python3 \
            bench/bench_gpu_cluster.py --manifest large --workers 16 ;;
        ready-speed-pocl) step ready-speed-pocl 240 env FARM_DEVICE=pocl $host sh -c \
            'export FARM_HOME=/tmp/h-speed PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0;
             python3 -m farm build medium --local --workers 16 > /dev/null &&
             POCL_CACHE_DIR=$(mktemp -d) python3 bench/probe_ready_speed.py medium --limit 60' ;;
        control-plane) step control-plane 540 $host python3 bench/bench_control_plane.py \
            --workers 8,32,128 --chunks 4 --rtt-ms 0.5,5 --kernels 2000 --clients 2 \
            --latency-rounds 24 ;;
        proofs-nvidia) step proofs-nvidia 200 $host python3 bench/bench_proofs.py \
            --device nvidia --rounds 2 --manifest medium ;;
        proofs-pocl) step proofs-pocl 200 env FARM_DEVICE=pocl $host python3 \
            bench/bench_proofs.py --device pocl --rounds 2 --manifest tiny ;;
        trust-pocl) step trust-pocl 200 env FARM_DEVICE=pocl $host python3 -m pytest -x -q \
            -p no:cacheprovider tests/test_program_trust.py tests/test_program_records.py ;;
        tune-nvidia) step tune-nvidia 360 $host sh -c \
            'python3 bench/bench_tune.py --manifest medium --workers 16 \
                 --parts tune,stability,exhaustive,lookup --lookup-manifest large &&
             python3 bench/bench_tune.py --manifest large --tokens 1,16,256 --workers 16 \
                 --parts tune,stability,exhaustive' ;;
        tune-pocl-noise) step tune-pocl-noise 180 env FARM_DEVICE=pocl $host python3 \
            bench/bench_tune.py --manifest medium --tokens 16 --parts interference \
            --noise-keys 4 --compilers 8 --noise-rounds 3 ;;
        # issue 31: the control plane at 8 and 32 workers, this tree beside the commit
        # before the round (.base/624c62d, made by bench/host_kit.sh) and a bare Celery
        # round trip, in one call, on one Redis and MinIO; where the added latency goes
        # (--timeline); a pool process's side of a chunk alone (cp_chunk.py); what a
        # request costs MinIO (bench_minio_put.py)
        # this tree against the commit exported in .base/ab (git archive REF farm worker
        # loader bench | tar -x -C .base/ab), in one call: the fleet at 8 and 32 workers
        # with a bare Celery round trip and the timeline, then a pool process's side alone,
        # the two codes alternating
        control-plane-ab) step control-plane-ab 480 $host sh -c \
            'python3 -m compileall -q -j 0 .base > /dev/null;
             python3 bench/bench_control_plane.py --workers 8,32 --chunks 4 --rtt-ms 0.5 \
                 --kernels 2000 --clients 2 --latency-rounds 24 --baseline .base/ab \
                 --bare --timeline;
             for i in 1 2; do
                 PYTHONPATH=.base/ab:$PYTHONPATH python3 .base/ab/bench/cp_chunk.py --chunks 300 --rtt-ms 0.5 | tail -1 | sed "s/^/ab: /";
                 python3 bench/cp_chunk.py --chunks 300 --rtt-ms 0.5 | tail -1 | sed "s/^/new: /";
             done' ;;
        control-plane-31) step control-plane-31 420 $host sh -c \
            'python3 -m compileall -q -j 0 .base > /dev/null;
             python3 bench/bench_control_plane.py --workers 8,32 --chunks 4 --rtt-ms 0.5 \
                 --kernels 2000 --clients 2 --latency-rounds 24 --baseline .base/624c62d \
                 --bare --timeline;
             python3 bench/cp_chunk.py --chunks 300 --rtt-ms 0.5;
             python3 bench/bench_minio_put.py --count 300' ;;
        control-plane-31-128) step control-plane-31-128 560 $host sh -c \
            'python3 -m compileall -q -j 0 .base > /dev/null;
             python3 bench/bench_control_plane.py --workers 128 --chunks 4 --rtt-ms 0.5 \
                 --kernels 3000 --clients 2 --latency-rounds 24 --baseline .base/624c62d \
                 --bare --timeline' ;;
        capture-pocl) step capture-pocl 230 env FARM_DEVICE=pocl $host sh -c \
            'python3 -m pytest -x -q -p no:cacheprovider tests/test_capture_ready.py -k "not cluster" &&
             python3 bench/bench_pyopencl_app.py --device pocl --rounds 2 --capture-row' ;;
        *) echo "h200_round.sh: no step named $name"; exit 2 ;;
    esac
done
