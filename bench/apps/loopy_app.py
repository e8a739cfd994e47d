"""A loopy application, as a user writes one (the benchmark's workload): a scaled copy
split into work-groups, a matrix product, a row sum and an elementwise expression with a
parameter, each on the application's own context and checked against numpy.

Prints one JSON line: ``{"ok": ..., "checks": N, "main_s": seconds from this file's first
line to the end, imports included}``. ``argv[1]`` (optional) is the device (substring of
its name or platform), default the first.
"""

import time

START = time.perf_counter()

import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402
import pyopencl.array as cla  # noqa: E402
from app_context import context_from_argv  # noqa: E402 (this folder)

warnings.filterwarnings("ignore", category=DeprecationWarning)
import loopy as lp  # noqa: E402

ctx = context_from_argv()
q = cl.CommandQueue(ctx)
rng = np.random.default_rng(3)
V = 2 ** 14
a = cla.to_device(q, rng.random(V).astype(np.float32))
scale = lp.make_kernel("{ [i]: 0<=i<n }", "out[i] = 2*a[i]", lang_version=(2018, 2))
scale = lp.split_iname(scale, "i", 64, outer_tag="g.0", inner_tag="l.0")
_, (o1,) = scale.executor(q)(q, a=a)
A = rng.random((64, 48)).astype(np.float32)
B = rng.random((48, 32)).astype(np.float32)
matmul = lp.make_kernel("{ [i,j,k]: 0<=i<n and 0<=j<m and 0<=k<l }",
                        "c[i, j] = sum(k, a[i, k]*b[k, j])", lang_version=(2018, 2))
matmul = lp.add_and_infer_dtypes(matmul, {"a,b": np.float32})
matmul = lp.split_iname(matmul, "i", 16, outer_tag="g.0", inner_tag="l.1")
matmul = lp.split_iname(matmul, "j", 16, outer_tag="g.1", inner_tag="l.0")
_, (o2,) = matmul.executor(q)(q, a=A, b=B)
rows = lp.make_kernel("{ [i,j]: 0<=i<n and 0<=j<m }", "s[i] = sum(j, x[i, j])",
                      lang_version=(2018, 2))
rows = lp.add_and_infer_dtypes(rows, {"x": np.float32})
rows = lp.tag_inames(rows, {"i": "g.0"})
X = rng.random((128, 50)).astype(np.float32)
_, (o3,) = rows.executor(q)(q, x=X)
expr = lp.make_kernel("{ [i]: 0<=i<n }", "y[i] = alpha*x[i]*x[i] + 1", lang_version=(2018, 2))
expr = lp.add_and_infer_dtypes(expr, {"x": np.float32, "alpha": np.float32})
expr = lp.split_iname(expr, "i", 128, outer_tag="g.0", inner_tag="l.0")
_, (o4,) = expr.executor(q)(q, x=a, alpha=np.float32(3))
res = {"scale": (o1.get(), 2 * a.get()), "matmul": (np.asarray(o2), A @ B),
       "rows": (np.asarray(o3), X.sum(axis=1)), "expr": (o4.get(), 3 * a.get() ** 2 + 1)}
bad = [k for k, (got, want) in res.items() if not np.allclose(got, want, rtol=1e-4,
                                                              atol=1e-4)]
print(json.dumps({"ok": not bad, "bad": bad, "checks": len(res),
                  "main_s": round(time.perf_counter() - START, 4)}))
sys.exit(1 if bad else 0)
