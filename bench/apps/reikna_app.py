"""A reikna application, as a user writes one (the benchmark's workload): a 2-D complex
FFT and its inverse, a 1-D FFT of another size, and two matrix products, every result
checked against numpy.

Prints one JSON line: ``{"ok": ..., "checks": N, "main_s": seconds from this file's first
line to the end, imports included}``. ``argv[1]`` (optional) is the device (substring of
its name or platform), default the first.
"""

import time

START = time.perf_counter()

import json  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402
from app_context import context_from_argv  # noqa: E402 (this folder)
from reikna.cluda import ocl_api  # noqa: E402
from reikna.fft import FFT  # noqa: E402
from reikna.linalg import MatrixMul  # noqa: E402

ctx = context_from_argv()
thr = ocl_api().Thread(cl.CommandQueue(ctx))
rng = np.random.default_rng(2)
x = (rng.random((64, 64)) + 1j * rng.random((64, 64))).astype(np.complex64)
fft2 = FFT(x, axes=(0, 1)).compile(thr)
xd = thr.to_device(x)
yd = thr.empty_like(xd)
fft2(yd, xd)
back = thr.empty_like(xd)
fft2(back, yd, inverse=True)
v = (rng.random(1000) + 1j * rng.random(1000)).astype(np.complex64)
fft1 = FFT(v).compile(thr)
vd = thr.to_device(v)
wd = thr.empty_like(vd)
fft1(wd, vd)
res = {"fft2": (yd.get(), np.fft.fft2(x)), "ifft2": (back.get(), x),
       "fft1": (wd.get(), np.fft.fft(v))}
for m, k, n in ((48, 32, 40), (100, 64, 36)):
    a = rng.random((m, k)).astype(np.float32)
    b = rng.random((k, n)).astype(np.float32)
    mm = MatrixMul(a, b, out_arr=np.empty((m, n), np.float32)).compile(thr)
    cd = thr.array((m, n), np.float32)
    mm(cd, thr.to_device(a), thr.to_device(b))
    res[f"matmul{m}"] = (cd.get(), a @ b)
bad = [k for k, (got, want) in res.items()
       if not np.allclose(got, want, rtol=1e-3, atol=1e-2 if "fft" in k else 1e-3)]
print(json.dumps({"ok": not bad, "bad": bad, "checks": len(res),
                  "main_s": round(time.perf_counter() - START, 4)}))
sys.exit(1 if bad else 0)
