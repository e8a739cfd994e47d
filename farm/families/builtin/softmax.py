"""Row-wise softmax of a ``[rows, cols]`` matrix: one work-group per row.

Numerically safe form: subtract the row maximum before exponentiating. Three passes
over the row (max, sum of exponentials, normalised write), each reduced across the
work-group with a tree in ``__local`` memory. Arithmetic is in float for half inputs.
"""

from __future__ import annotations

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


class SoftmaxParams(Params):
    """``cols`` is compile-time; ``rows`` is the number of work-groups launched."""

    cols: RowLength
    group_size: GroupSize = 64
    dtype: DType = "float"


class Softmax(KernelFamily[SoftmaxParams]):
    """``out[r, c] = exp(x[r, c] - max_r) / sum_c' exp(x[r, c'] - max_r)``."""

    name = "softmax"
    params_model = SoftmaxParams
    example_params = ({"cols": 100, "group_size": 32},)

    def lower(self, params: SoftmaxParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        body = (
            "    __global const T *xr = x + row * COLS;\n"
            "    __global T *outr = out + row * COLS;\n"
            "    ACC m = (ACC)(-INFINITY);\n"
            "    for (uint c = lid; c < COLS; c += G) m = fmax(m, (ACC)xr[c]);\n"
            f"{tree_reduce('m', 'row_max', 'fmax({a}, {b})')}"
            "    ACC s = (ACC)0;\n"
            "    for (uint c = lid; c < COLS; c += G) s += exp((ACC)xr[c] - row_max);\n"
            f"{tree_reduce('s', 'row_sum', '{a} + {b}')}"
            "    const ACC inv = (ACC)1 / row_sum;\n"
            "    for (uint c = lid; c < COLS; c += G)\n"
            "        outr[c] = (T)(exp((ACC)xr[c] - row_max) * inv);\n"
        )
        return lower_row_kernel(
            self, params, launch, device,
            KernelCode(kernel="softmax",
                       args=("__global const T *restrict x",
                             "__global T *restrict out"),
                       defines={"COLS": f"{params.cols}u"},
                       body=body))

    def example(self, params: SoftmaxParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        rows = 3
        # a large offset: a kernel that forgot the max subtraction overflows exp
        x = (rng.normal(0.0, 2.0, (rows, params.cols)) + 100.0).astype(dtype)
        out = np.zeros_like(x)
        x64 = x.astype(np.float64)
        e = np.exp(x64 - x64.max(axis=1, keepdims=True))
        want = e / e.sum(axis=1, keepdims=True)
        return row_example("softmax", params, rows, [x, out], {1: want})
