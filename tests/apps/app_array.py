"""A pyopencl.array application (clmath, a reduction, a scan, an elementwise kernel,
Philox random numbers), checked against numpy; writes its results to ``argv[1]`` (.npz)
so a test can compare a run through the farm with a plain one, byte for byte."""

import sys

import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pyopencl.clmath as clm
import pyopencl.clrandom as clr
from pyopencl.elementwise import ElementwiseKernel
from pyopencl.reduction import ReductionKernel
from pyopencl.scan import InclusiveScanKernel

ctx = cl.create_some_context(interactive=False)
q = cl.CommandQueue(ctx)
rng = np.random.default_rng(1)
n = 4096
a = rng.random(n).astype(np.float32)
b = rng.random(n).astype(np.float32)
ga, gb = cla.to_device(q, a), cla.to_device(q, b)
out = {}
out["axpb"] = (2 * ga + gb).get()
out["sin"] = clm.sin(ga).get()
out["sum"] = cla.sum(ga).get()
dot = ReductionKernel(ctx, np.float32, neutral="0", reduce_expr="a+b",
                      map_expr="x[i]*y[i]", arguments="__global const float *x, "
                                                      "__global const float *y")
out["dot"] = dot(ga, gb).get()
ints = cla.to_device(q, rng.integers(0, 100, n).astype(np.int32))
out["scan"] = InclusiveScanKernel(ctx, np.int32, "a+b", neutral="0")(ints.copy()).get()
lin = ElementwiseKernel(ctx, "float *z, const float *x, float k", "z[i] = k*x[i] + 1", "lin")
z = cla.empty_like(ga)
lin(z, ga, np.float32(4))
out["lin"] = z.get()
out["philox"] = clr.PhiloxGenerator(ctx, seed=5).uniform(q, 1024, np.float32).get()
want = {"axpb": 2 * a + b, "sin": np.sin(a), "sum": a.sum(dtype=np.float64),
        "dot": np.dot(a.astype(np.float64), b), "scan": np.cumsum(ints.get()),
        "lin": 4 * a + 1}
bad = [k for k, v in want.items() if not np.allclose(out[k], v, rtol=1e-4, atol=1e-3)]
r = out["philox"]
if not (r.min() >= 0 and r.max() <= 1 and abs(r.mean() - 0.5) < 0.05):
    bad.append("philox")
np.savez(sys.argv[1], **out)
print("array app:", "OK" if not bad else f"MISMATCH {bad}")
sys.exit(1 if bad else 0)
