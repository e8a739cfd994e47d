"""The peer of ``bench/bench_control_plane.py``: a bare Celery task round trip on the
same Redis, with the farm's Celery configuration (``farm.cluster.celery_app.make_app``:
JSON, late acknowledgement, prefetch 1, events as ``FARM_WORKER_EVENTS`` says) and no
farm at all in the task.

One task stands for one chunk: its payload is a chunk's worth of kernel requests (as
the farm sends them), the task sleeps what the chunk's compiles would (chunk x compile
time) and returns a reply of a chunk's size. So per task it costs what Celery itself
costs a chunk; divided by the chunk size, what Celery costs a kernel: the floor under
the farm's figures, and what is the farm's own.

    celery -A cp_bare worker ...          (the benchmark starts it: FARM_REDIS_URL, BARE_*)
    python bench/cp_bare.py --mode throughput --tasks 250 --chunk 4 --compile-ms 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
import uuid
from typing import Any

from farm.cluster.celery_app import make_app
from farm.core.settings import load_settings

TASK = "bench.bare_chunk"
QUEUE = "bench.bare"

app = make_app(load_settings())


@app.task(name=TASK, acks_late=True)
def bare_chunk(payload: dict[str, Any]) -> dict[str, Any]:
    """Sleep the chunk's compiles; answer as many kernel replies as were asked."""
    kernels = payload.get("kernels", [])
    time.sleep(float(os.environ.get("BARE_SLEEP_S", "0")))
    return {"results": [{"id_hash": k["artifact"]["kernel"]["params"]["run"] + str(i),
                         "key": "0" * 32 + ":" + "0" * 16, "outcome": "Compiled",
                         "failure": None, "work_s": 0.005, "worker": "bare", "host": "bare"}
                        for i, k in enumerate(kernels)], "dropped": ""}


def _payload(chunk: int, tag: str, first: int) -> dict[str, Any]:
    """A chunk's payload, shaped as the farm's (``CompileRequest``)."""
    return {"fingerprint": "0" * 16, "build": uuid.uuid4().hex, "requested_by": None,
            "programs": [],
            "kernels": [{"artifact": {"kernel": {"family": "sim_compile",
                                                 "params": {"index": first + i, "run": tag},
                                                 "launch": None}, "variant": {}},
                         "build_id": "0" * 16} for i in range(chunk)]}


def client_main(args: argparse.Namespace) -> None:
    """Send tasks and gather their results as the farm's client does (one ResultSet,
    ``iter_native`` with ``interval=0``); print one JSON line."""
    from celery.result import ResultSet

    tag = uuid.uuid4().hex[:10]
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    out: dict[str, Any] = {"tag": tag}
    sent: dict[str, float] = {}
    arrived: dict[str, float] = {}
    walls: dict[str, list[float]] = {}  # task id -> [sent, arrived], wall clock

    def run(count: int, first: int) -> None:
        results = []
        for i in range(count):
            task_id = str(uuid.uuid4())
            sent[task_id] = time.perf_counter()
            walls[task_id] = [time.time()]
            results.append(app.send_task(TASK, args=[_payload(args.chunk, tag, first + i)],
                                         queue=QUEUE, task_id=task_id))
        rs = ResultSet(results, app=app)
        for task_id, _meta in app.backend.iter_native(rs, timeout=600, interval=0):
            arrived[task_id] = time.perf_counter()
            walls[task_id].append(time.time())
        app.backend.client.delete(*[app.backend.get_key_for_task(r.id) for r in results])

    if args.mode == "throughput":
        start = time.time()
        run(args.tasks, 0)
        out.update(start=start, end=time.time(), tasks=args.tasks)
    else:
        done = 0
        while done < args.tasks:
            count = min(args.free, args.tasks - done)
            run(count, done * args.chunk)
            done += count
        chunk_s = args.chunk * args.compile_ms / 1000
        out["added_s"] = [arrived[t] - sent[t] - chunk_s for t in sent]
        out["chunks"] = [{"task": t, "sent": w[0], "arrived": w[1]} for t, w in walls.items()]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = (usage.ru_utime + usage.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
    print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("throughput", "latency"), required=True)
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--compile-ms", type=float, default=5.0)
    parser.add_argument("--free", type=int, default=1)
    client_main(parser.parse_args())


if __name__ == "__main__":
    main()
