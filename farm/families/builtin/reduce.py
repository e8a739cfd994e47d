"""Row reductions (sum, max, mean) of a ``[rows, cols]`` matrix: one work-group per row.

Each work-item folds a strided slice of its row in private memory, then the group
combines the partial values with a tree in ``__local`` memory. ``cols`` is baked in, so
the strided loop has a constant trip count the compiler can unroll; ``rows`` is the
launch's number of work-groups and needs no argument.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from farm.device import DeviceInfo
from farm.families.base import Example, KernelFamily, Params
from farm.families.builtin.common import (
    NUMPY,
    SIZEOF,
    DType,
    GroupSize,
    acc_type,
    fixed_local_size,
    pragmas,
    reqd_wg,
    tolerance,
    tree_reduce,
)
from farm.model import LaunchSettings, Lowered

Op = Literal["sum", "max", "mean"]

#: (initial value, combine expression) in the arithmetic type
_FOLD = {"sum": ("(ACC)0", "{a} + {b}"), "mean": ("(ACC)0", "{a} + {b}"),
         "max": ("(ACC)(-INFINITY)", "fmax({a}, {b})")}


class ReduceParams(Params):
    """``cols`` is compile-time (constant trip count); ``rows`` is the launch's."""

    op: Op
    cols: int = Field(ge=1, le=1 << 20)
    group_size: GroupSize = 64
    dtype: DType = "float"


class Reduce(KernelFamily[ReduceParams]):
    """``out[r] = op(x[r, :])``: one value per row."""

    name = "reduce"
    params_model = ReduceParams
    depends_on = ("farm.families.builtin.common",)

    def lower(self, params: ReduceParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        self.check_dtype(device, params.dtype)
        g = params.group_size
        local = fixed_local_size(self.name, launch, (g,))
        self.check_work_group(device, local)
        acc = acc_type(params.dtype)
        self.check_local_mem(device, g * SIZEOF[acc])
        init, combine = _FOLD[params.op]
        step = combine.format(a="v", b="(ACC)xr[c]")
        result = "r / (ACC)COLS" if params.op == "mean" else "r"
        kernel = f"reduce_{params.op}"
        source = (
            f"{pragmas(params.dtype)}"
            f"#define T {params.dtype}\n#define ACC {acc}\n"
            f"#define COLS {params.cols}u\n#define G {g}u\n"
            f"{reqd_wg(local)}__kernel void {kernel}(\n"
            "    __global const T *restrict x, __global T *restrict out)\n"
            "{\n"
            "    __local ACC red[G];\n"
            "    const uint lid = get_local_id(0);\n"
            "    const size_t row = get_group_id(0);\n"
            "    __global const T *xr = x + row * COLS;\n"
            f"    ACC v = {init};\n"
            f"    for (uint c = lid; c < COLS; c += G) v = {step};\n"
            f"{tree_reduce('red', 'v', 'r', combine, g, 'ACC')}"
            f"    if (lid == 0) out[row] = (T)({result});\n"
            "}\n"
        )
        return Lowered(source=source, kernel_names=(kernel,))

    def example(self, params: ReduceParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        rows = 3
        x = rng.uniform(-1.0, 1.0, (rows, params.cols)).astype(dtype)
        out = np.zeros(rows, dtype=dtype)
        x64 = x.astype(np.float64)
        want = {"sum": x64.sum(axis=1), "max": x64.max(axis=1),
                "mean": x64.mean(axis=1)}[params.op]
        rtol, atol = tolerance(params.dtype)
        if params.op == "sum":  # rounding grows with the number of terms
            atol *= max(1.0, float(np.sqrt(params.cols)))
        g = params.group_size
        return Example(kernel_name=f"reduce_{params.op}", args=[x, out],
                       global_size=(rows * g,), local_size=(g,), expected={1: want},
                       rtol=rtol, atol=atol)
