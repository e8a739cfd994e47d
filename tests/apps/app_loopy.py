"""loopy's tutorial-sized kernels on the application's own context, checked against
numpy; writes its results to ``argv[1]`` (.npz).

The third kernel splits its reduction by a length that does not divide it, so the inner
loop's bounds have several pieces and loopy's code generation calls islpy's
``Aff.is_equal`` (``loopy.isl_helpers.simplify_pw_aff``): the call islpy 2026 removed,
which is why the dev extra keeps islpy below 2026 for loopy 2025.2."""

import sys
import warnings

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

warnings.filterwarnings("ignore", category=DeprecationWarning)
import loopy as lp  # noqa: E402

ctx = cl.create_some_context(interactive=False)
q = cl.CommandQueue(ctx)
rng = np.random.default_rng(3)
a = cla.to_device(q, rng.random(1000).astype(np.float32))
scale = lp.make_kernel("{ [i]: 0<=i<n }", "out[i] = 2*a[i]", lang_version=(2018, 2))
scale = lp.split_iname(scale, "i", 64, outer_tag="g.0", inner_tag="l.0")
_, (o1,) = scale.executor(q)(q, a=a)
A = rng.random((32, 24)).astype(np.float32)
B = rng.random((24, 16)).astype(np.float32)
matmul = lp.make_kernel("{ [i,j,k]: 0<=i<n and 0<=j<m and 0<=k<l }",
                        "c[i, j] = sum(k, a[i, k]*b[k, j])", lang_version=(2018, 2))
matmul = lp.add_and_infer_dtypes(matmul, {"a,b": np.float32})
_, (o2,) = matmul.executor(q)(q, a=A, b=B)
C = rng.random((8, 50)).astype(np.float32)
D = rng.random((50, 4)).astype(np.float32)
split = lp.split_iname(matmul, "k", 16)  # 50 = 3 * 16 + 2: a bound of two pieces
_, (o3,) = split.executor(q)(q, a=C, b=D)
out = {"scale": o1.get(), "matmul": np.asarray(o2), "split": np.asarray(o3)}
ok = (np.allclose(out["scale"], 2 * a.get()) and np.allclose(out["matmul"], A @ B, rtol=1e-4)
      and np.allclose(out["split"], C @ D, rtol=1e-4))
np.savez(sys.argv[1], **out)
print("loopy app:", "OK" if ok else "MISMATCH")
sys.exit(0 if ok else 1)
