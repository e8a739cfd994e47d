"""A multiprocessing application: each task builds and launches its own program in a
child process. ``argv``: start method (fork, spawn, forkserver), how the children end
(``with``: the pool's ``terminate()``, ``close``: ``close()`` and ``join()``,
``futures``: a ``concurrent.futures`` process pool, ``kill``: a child killed outright
after its build), the number of tasks."""

import multiprocessing as mp
import os
import signal
import sys

import numpy as np


def work(i: int) -> int:
    import pyopencl as cl

    ctx = cl.Context([cl.get_platforms()[0].get_devices()[0]])
    q = cl.CommandQueue(ctx)
    # a long name: the farm's compile tells a program's folder by its kernels' names
    name = f"pool_application_task_{i}"
    src = f"__kernel void {name}(__global int *a) {{ a[get_global_id(0)] = {i}; }}"
    kernel = cl.Kernel(cl.Program(ctx, src).build(), name)
    buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, 16 * 4)
    kernel(q, (16,), (8,), buf)
    out = np.empty(16, np.int32)
    cl.enqueue_copy(q, out, buf)
    return int(out.sum())


def killed(i: int) -> None:
    work(i)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    method, how, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx = mp.get_context(method)
    if how == "with":
        with ctx.Pool(2) as pool:
            total = sum(pool.map(work, range(n)))
    elif how == "close":
        pool = ctx.Pool(2)
        total = sum(pool.map(work, range(n)))
        pool.close()
        pool.join()
    elif how == "futures":
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(2, mp_context=ctx) as ex:
            total = sum(ex.map(work, range(n)))
    else:
        child = ctx.Process(target=killed, args=(0,))
        child.start()
        child.join()
        total = 0
    want = sum(16 * i for i in range(n)) if how != "kill" else 0
    print("pool app:", "OK" if total == want else f"MISMATCH {total} != {want}")
    sys.exit(0 if total == want else 1)
