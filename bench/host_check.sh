#!/usr/bin/env bash
# On the GPU host, from the repository root, with .whl/ and .kit/ carried: does the kit
# work there? Then, as far as STEP_S seconds allow, the GPU cluster test and a first
# control-plane point. Logs go to $OUT (the device tool's folder) when it is set.
#   bench/host_check.sh                 # all steps
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/host-check}"
mkdir -p "$OUT"
step() { printf '\n== %s (%s s)\n' "$*" "$SECONDS"; }

step "host"
nproc; free -g | sed -n 1,2p; sed -n 1,2p /etc/os-release; python3 --version; id -u
for t in xz tc ip gcc go redis-server; do printf '%s: %s\n' "$t" "$(command -v "$t" || echo missing)"; done

step "network namespaces and netem"
ns=kfb-check-$$
if ip netns add "$ns" 2>&1; then
    ip -n "$ns" link set lo up && echo "ip netns: ok"
    if ip link add kfb-h$$ type veth peer name kfb-n$$ netns "$ns" 2>&1; then
        echo "veth: ok"; ip link del kfb-h$$ 2>/dev/null
    fi
    if ip netns exec "$ns" tc qdisc add dev lo root netem delay 1ms 2>&1; then
        echo "netem: ok"
        ip netns exec "$ns" python3 - <<'EOF'
import socket, time
s = socket.create_server(("127.0.0.1", 0)); port = s.getsockname()[1]
c = socket.create_connection(("127.0.0.1", port)); a, _ = s.accept()
ts = []
for _ in range(50):
    t = time.perf_counter(); c.sendall(b"x"); a.recv(1); a.sendall(b"y"); c.recv(1)
    ts.append(time.perf_counter() - t)
print(f"netem 1 ms on lo: round trip p50 {sorted(ts)[25] * 1000:.2f} ms")
EOF
    else
        echo "netem: NOT available ($(lsmod 2>/dev/null | grep -c sch_netem) sch_netem loaded)"
    fi
    ip netns del "$ns"
fi

step "install, servers, devices"
bench/nvidia_host.sh python3 - <<'EOF' 2>&1 | tee "$OUT/servers.log"
import os, subprocess
from farm.devservices import MinioServer, RedisServer
print("FARM_REDIS_BIN", os.environ.get("FARM_REDIS_BIN"), "FARM_MINIO_BIN", os.environ.get("FARM_MINIO_BIN"))
with RedisServer() as r, MinioServer() as m:
    import redis
    print("redis", redis.Redis.from_url(r.url).info("server")["redis_version"], r.url)
    print("minio", subprocess.run([os.environ["FARM_MINIO_BIN"], "--version"], capture_output=True, text=True).stdout.splitlines()[0], m.endpoint)
from farm.core.device import discover_devices
for d in discover_devices():
    print("device", d.fingerprint, "|", d.platform_name, "|", d.device_name, "|", d.native_arch)
EOF

step "GPU cluster test"
timeout "${STEP_S:-270}" bench/nvidia_host.sh python3 -m pytest -m gpu -s -p no:cacheprovider \
    tests/test_gpu_cluster.py 2>&1 | tee "$OUT/gpu-cluster-test.log" | grep -E "GPU_CLUSTER|passed|failed|Error|error" | cut -c1-600

step "control plane: a first point"
timeout "${CP_S:-100}" bench/nvidia_host.sh python3 bench/bench_control_plane.py \
    ${CP_ARGS:---workers 128 --chunks 4 --rtt-ms 0,0.5 --kernels 2000 --clients 2 --latency-rounds 20} \
    --out "$OUT/control-plane.jsonl" > "$OUT/control-plane.log" 2>&1
tail -5 "$OUT/control-plane.log" | cut -c1-1500
step "done"
