"""A pyopencl.array application, as a user writes one (the benchmark's workload):
elementwise arithmetic, clmath, reductions, a ReductionKernel, scans, an
ElementwiseKernel, comparisons, where, casts and Philox random numbers; 29 program builds
(27 distinct sources) with pyopencl 2026.1, each result checked against numpy.

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
import pyopencl.array as cla  # noqa: E402
import pyopencl.clmath as clm  # noqa: E402
import pyopencl.clrandom as clr  # noqa: E402
from app_context import context_from_argv  # noqa: E402 (this folder)
from pyopencl.elementwise import ElementwiseKernel  # noqa: E402
from pyopencl.reduction import ReductionKernel  # noqa: E402
from pyopencl.scan import InclusiveScanKernel  # noqa: E402

ctx = context_from_argv()
q = cl.CommandQueue(ctx)
rng = np.random.default_rng(1)
n = 10000
a = rng.random(n).astype(np.float32)
b = rng.random(n).astype(np.float32)
ga, gb = cla.to_device(q, a), cla.to_device(q, b)
res = {
    "axpb": ((2 * ga + gb * 3 - 1).get(), 2 * a + b * 3 - 1),
    "sin": (clm.sin(ga).get(), np.sin(a)),
    "exp": (clm.exp(gb).get(), np.exp(b)),
    "sqrt": (clm.sqrt(ga).get(), np.sqrt(a)),
    "sum": (cla.sum(ga).get(), a.sum(dtype=np.float64)),
    "dot": (cla.dot(ga, gb).get(), np.dot(a.astype(np.float64), b)),
    "max": (cla.max(ga).get(), a.max()),
}
dot2 = ReductionKernel(ctx, np.float32, neutral="0", reduce_expr="a+b",
                       map_expr="x[i]*y[i]*2",
                       arguments="__global const float *x, __global const float *y")
res["redk"] = (dot2(ga, gb).get(), 2 * np.dot(a.astype(np.float64), b))
ia = cla.to_device(q, rng.integers(0, 100, n).astype(np.int32))
scan = InclusiveScanKernel(ctx, np.int32, "a+b", neutral="0")
res["scan"] = (scan(ia.copy()).get(), np.cumsum(ia.get()))
res["cumsum"] = (cla.cumsum(ia).get(), np.cumsum(ia.get()))
lin = ElementwiseKernel(ctx, "float *z, const float *x, float k", "z[i] = k*x[i] + 1", "lin")
z = cla.empty_like(ga)
lin(z, ga, np.float32(4))
res["ewk"] = (z.get(), 4 * a + 1)
r = clr.PhiloxGenerator(ctx, seed=5).uniform(q, n, np.float32).get()
res["philox"] = (np.array([r.min() >= 0, r.max() <= 1, abs(r.mean() - 0.5) < 0.02]),
                 np.array([True, True, True]))
res["cmp"] = ((ga > 0.5).get(), a > 0.5)
res["where"] = (cla.if_positive(ga - 0.5, ga, gb).get(), np.where(a - 0.5 > 0, a, b))
res["astype"] = (ga.astype(np.float64).get(), a.astype(np.float64))
bad = [k for k, (x, y) in res.items() if not np.allclose(x, y, rtol=1e-4, atol=1e-4)]
print(json.dumps({"ok": not bad, "bad": bad, "checks": len(res),
                  "main_s": round(time.perf_counter() - START, 4)}))
sys.exit(1 if bad else 0)
