"""A pool process's side of a chunk, alone: what ``bench/bench_control_plane.py``'s
workers spend a kernel beyond Celery, measured in one process without the fleet's noise.

One worker state as a pool process opens it (``worker.state.open_state``: the simulated
device and family of ``bench/simfleet.py``, the MinIO store with its metrics, the lease
client, the records session) on a Redis and a MinIO started here (behind the delay
proxy for ``--rtt-ms``), and ``--chunks`` chunks of ``--chunk`` new kernels each, run
one after the other as the task runs them (the payload validated, ``execute_job`` with
a first delivery of a live build, the metrics and the log line). Per kernel: the
process's CPU (every thread's: the store's threads too), and a chunk's wall beyond its
compiles, p50 and p99; with ``--profile``, cProfile of the run (every thread) by own
and cumulative time. Celery's share (receiving the message, the pool's hand-over, the
trace, acknowledging) is not in it: the bare Celery round trip measures that.

    .venv/bin/python bench/cp_chunk.py --rtt-ms 0.5 --chunks 300 [--profile 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=300)
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--compile-ms", type=float, default=5.0)
    parser.add_argument("--binary-bytes", type=int, default=32768)
    parser.add_argument("--rtt-ms", type=float, default=0.5)
    parser.add_argument("--profile", type=int, metavar="N", default=0,
                        help="also run under cProfile and print the top N functions")
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH))
    for name in [k for k in os.environ if k.startswith("FARM_") and not k.endswith("_BIN")]:
        del os.environ[name]

    from cp_points import SIM, start_proxy

    from farm.devservices import MinioServer, RedisServer

    with tempfile.TemporaryDirectory(prefix="farm-bench-chunk-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        redis = stack.enter_context(RedisServer(work))
        minio = stack.enter_context(MinioServer(work))
        redis_addr = redis.url.split("//", 1)[1].split("/", 1)[0]
        minio_addr = minio.endpoint
        if args.rtt_ms > 0:
            redis_addr = start_proxy(redis_addr, args.rtt_ms / 2, stack)
            minio_addr = start_proxy(minio_addr, args.rtt_ms / 2, stack)
        os.environ.update({
            **SIM, "FARM_HOME": str(work / "home"), "FARM_REDIS_URL": f"redis://{redis_addr}/0",
            "FARM_MINIO_ENDPOINT": minio_addr, "FARM_MINIO_ACCESS_KEY": minio.access_key,
            "FARM_MINIO_SECRET_KEY": minio.secret_key, "FARM_MINIO_BUCKET": "cp-chunk",
            "SIM_COMPILE_MS": str(args.compile_ms),
            "SIM_BINARY_BYTES": str(args.binary_bytes)})
        row = run(args)
        print(json.dumps(row), flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import simfleet

    from farm.core.settings import load_settings
    from farm.store.open import open_store
    from worker.state import open_state

    settings = load_settings()
    open_store(settings, shared=True).close()  # the bucket (a worker's main process's)
    state = open_state(settings, [simfleet.device_info()], 0)
    try:
        chunk_task(state, args, "warm", 20)
        cpu0, t0 = time.process_time(), time.perf_counter()
        walls = chunk_task(state, args, "run", args.chunks)
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - t0
        kernels = args.chunks * args.chunk
        row: dict[str, Any] = {
            "bench": "cp_chunk", "chunk": args.chunk, "rtt_ms": args.rtt_ms,
            "compile_ms": args.compile_ms, "chunks": args.chunks,
            "cpu_ms_per_kernel": round(1000 * cpu / kernels, 3),
            "chunk_wall_beyond_compiles_ms": {
                "p50": round(1000 * _pct(walls, 0.5), 2),
                "p99": round(1000 * _pct(walls, 0.99), 2)},
            "kernels_per_s_one_process": round(kernels / wall, 1),
            "loadavg": round(os.getloadavg()[0], 2), "cores": os.cpu_count()}
        if args.profile:
            profile(state, args)
        return row
    finally:
        state.close()


def chunk_task(state: Any, args: argparse.Namespace, tag: str, count: int) -> list[float]:
    """``count`` chunks through what the task does; each one's wall beyond its compiles."""
    from celery.utils.log import get_task_logger

    from farm.cluster.metrics import worker_metrics
    from farm.cluster.payloads import CompileRequest, KernelRequest, parse_request
    from farm.core.keys import build_alive_key, build_replies_key
    from farm.core.model import ArtifactId, KernelId
    from farm.programs.request import ChunkRequest
    from worker.chunks import Delivery
    from worker.execute import execute_job
    from worker.hooks.metrics import chunk_status

    log = get_task_logger("bench.cp_chunk")
    build = uuid.uuid4().hex
    state.client.set(build_alive_key(build), "1", ex=600)
    state.client.xadd(build_replies_key(build), {"start": "1"})
    family = state.registry.get("sim_compile")
    run_tag = f"{tag}-{uuid.uuid4().hex[:8]}"
    metrics = worker_metrics()
    walls = []
    for c in range(count):
        payload = CompileRequest(
            fingerprint=state.device.fingerprint, build=build,
            kernels=[KernelRequest(artifact=ArtifactId(kernel=KernelId(
                family="sim_compile", params={"index": c * args.chunk + i, "run": run_tag})),
                build_id=family.build_id) for i in range(args.chunk)]).model_dump(mode="json")
        t = time.perf_counter()
        request = parse_request(payload, ChunkRequest)
        delivery = Delivery(task_id=str(uuid.uuid4()), build=build, worker="bench:1",
                            redelivered=False)
        reply = execute_job(request, state, delivery=delivery)
        metrics.task(request.fingerprint, chunk_status(reply))
        metrics.reply(request.fingerprint, reply)
        log.info("chunk %s: %d", delivery.task_id, len(reply.results))
        walls.append(time.perf_counter() - t - args.chunk * args.compile_ms / 1000)
        if not delivery.pushed or any(r.failure for r in reply.results):
            sys.exit(f"chunk {c}: not built as expected: {reply}")
    return walls


def profile(state: Any, args: argparse.Namespace) -> None:
    """cProfile of every thread over a run of its own, in CPU time (``time.thread_time``:
    a thread waiting for a reply costs nothing), which profiling inflates."""
    prof = cProfile.Profile(time.thread_time)
    profiles = [prof]

    def per_thread(*_: Any) -> None:  # each store thread gets its own profiler
        sys.setprofile(None)
        p = cProfile.Profile(time.thread_time)
        profiles.append(p)
        p.enable()

    threading.setprofile(per_thread)
    state.io.shutdown(wait=True)  # new threads, made under the profile hook
    state.__dict__.pop("io", None)
    prof.enable()
    chunk_task(state, args, "prof", max(50, args.chunks // 4))
    prof.disable()
    threading.setprofile(None)
    state.io.shutdown(wait=True)
    out = io.StringIO()
    stats = pstats.Stats(profiles[0], stream=out)
    for p in profiles[1:]:
        stats.add(p)
    stats.sort_stats("tottime").print_stats(args.profile)
    stats.sort_stats("cumulative").print_stats(args.profile)
    print(out.getvalue())


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


if __name__ == "__main__":
    main()
