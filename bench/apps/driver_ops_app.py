"""What a driver does at a process's first copy, fill and launch, with no program of the
application's own served: a context, a queue, host-to-device, device-to-device and
device-to-host copies, a fill, and one tiny kernel built from source, each timed at its
first and second call (``bench/probe_served_start.py`` runs it with the drivers' caches
off and warm: an operation whose first call costs tens of milliseconds only with the
cache off is one the driver translates code for).

Prints one JSON line ``{"ms": {"<op> 1": ..., "<op> 2": ...}}``. ``argv[1]`` (optional)
is the device (substring of its name or platform), default the first.
"""

import json
import time

import numpy as np
import pyopencl as cl
from app_context import context_from_argv  # this folder

ms: dict[str, float] = {}


def timed(name: str, fn) -> None:
    for i in (1, 2):
        t = time.perf_counter()
        fn()
        q.finish()
        ms[f"{name} {i}"] = round((time.perf_counter() - t) * 1000, 3)


t0 = time.perf_counter()
ctx = context_from_argv()
ms["context"] = round((time.perf_counter() - t0) * 1000, 3)
q = cl.CommandQueue(ctx)
host = np.arange(1 << 16, dtype=np.float32)
back = np.empty_like(host)
mf = cl.mem_flags
a = cl.Buffer(ctx, mf.READ_WRITE, host.nbytes)
b = cl.Buffer(ctx, mf.READ_WRITE, host.nbytes)
timed("copy host->device", lambda: cl.enqueue_copy(q, a, host))
timed("copy device->device", lambda: cl.enqueue_copy(q, b, a))
timed("copy device->host", lambda: cl.enqueue_copy(q, back, b))
timed("fill", lambda: cl.enqueue_fill_buffer(q, a, np.float32(1), 0, host.nbytes))
src = "__kernel void twice(__global float *x) { x[get_global_id(0)] *= 2; }"
built = {}
timed("build from source", lambda: built.update(k=cl.Kernel(cl.Program(ctx, src).build(),
                                                            "twice")))
timed("launch", lambda: built["k"](q, (host.size,), None, a))
print(json.dumps({"ms": ms}))
