"""Row reductions (sum, max, mean) of a ``[rows, cols]`` matrix: one work-group per row.

Each work-item folds a strided slice of its row in private memory, then the group
combines the partial values with a tree in ``__local`` memory. ``cols`` is baked in, so
the strided loop has a constant trip count the compiler can unroll; ``rows`` is the
launch's number of work-groups and needs no argument.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from farm.core.device import DeviceInfo
from farm.core.model import LaunchSettings, Lowered
from farm.families.base import Example, KernelFamily, Params
from farm.families.builtin.common import (
    NUMPY,
    DType,
    GroupSize,
    KernelCode,
    RowLength,
    lower_row_kernel,
    row_example,
    tree_reduce,
)

Op = Literal["sum", "max", "mean"]

#: (initial value, combine expression) in the arithmetic type
_FOLD = {"sum": ("(ACC)0", "{a} + {b}"), "mean": ("(ACC)0", "{a} + {b}"),
         "max": ("(ACC)(-INFINITY)", "fmax({a}, {b})")}


class ReduceParams(Params):
    """``cols`` is compile-time (constant trip count); ``rows`` is the launch's."""

    op: Op
    cols: RowLength
    group_size: GroupSize = 64
    dtype: DType = "float"


class Reduce(KernelFamily[ReduceParams]):
    """``out[r] = op(x[r, :])``: one value per row."""

    name = "reduce"
    params_model = ReduceParams
    example_params = ({"op": "sum", "cols": 100, "group_size": 32},)

    def lower(self, params: ReduceParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        init, combine = _FOLD[params.op]
        step = combine.format(a="v", b="(ACC)xr[c]")
        result = "r / (ACC)COLS" if params.op == "mean" else "r"
        body = (
            "    __global const T *xr = x + row * COLS;\n"
            f"    ACC v = {init};\n"
            f"    for (uint c = lid; c < COLS; c += G) v = {step};\n"
            f"{tree_reduce('v', 'r', combine)}"
            f"    if (lid == 0) out[row] = (T)({result});\n"
        )
        return lower_row_kernel(
            self, params, launch, device,
            KernelCode(kernel=f"reduce_{params.op}",
                       args=("__global const T *restrict x",
                             "__global T *restrict out"),
                       defines={"COLS": f"{params.cols}u"},
                       body=body))

    def example(self, params: ReduceParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        rows = 3
        x = rng.uniform(-1.0, 1.0, (rows, params.cols)).astype(dtype)
        out = np.zeros(rows, dtype=dtype)
        x64 = x.astype(np.float64)
        want = {"sum": x64.sum(axis=1), "max": x64.max(axis=1),
                "mean": x64.mean(axis=1)}[params.op]
        # the rounding of a sum grows with the number of terms
        scale = max(1.0, float(np.sqrt(params.cols))) if params.op == "sum" else 1.0
        return row_example(f"reduce_{params.op}", params, rows, [x, out], {1: want},
                           atol_scale=scale)
