"""RMS normalisation of rows with a learned scale: one work-group per row.

``out = x / sqrt(mean(x^2) + eps) * weight`` (as in Llama). The sum of squares is
reduced across the work-group with a tree in ``__local`` memory, in float for half
inputs; ``hidden`` and ``eps`` are baked into the source.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from farm.core.device import DeviceInfo
from farm.core.model import LaunchSettings, Lowered
from farm.families.base import Example, KernelFamily, Params
from farm.families.builtin.common import (
    NUMPY,
    DType,
    GroupSize,
    KernelCode,
    RowLength,
    acc_type,
    literal,
    lower_row_kernel,
    row_example,
    tree_reduce,
)


class RmsnormParams(Params):
    """``hidden`` and ``eps`` are compile-time; ``rows`` is the launch's."""

    hidden: RowLength
    group_size: GroupSize = 64
    eps: float = Field(default=1e-6, gt=0.0, le=1.0, allow_inf_nan=False)
    dtype: DType = "float"


class Rmsnorm(KernelFamily[RmsnormParams]):
    """``out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight``."""

    name = "rmsnorm"
    params_model = RmsnormParams
    example_params = ({"hidden": 100, "group_size": 32},)

    def lower(self, params: RmsnormParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        body = (
            "    __global const T *xr = x + row * HIDDEN;\n"
            "    __global T *outr = out + row * HIDDEN;\n"
            "    ACC ss = (ACC)0;\n"
            "    for (uint c = lid; c < HIDDEN; c += G) {\n"
            "        const ACC v = (ACC)xr[c];\n"
            "        ss += v * v;\n"
            "    }\n"
            f"{tree_reduce('ss', 'total', '{a} + {b}')}"
            "    const ACC inv = rsqrt(total / (ACC)HIDDEN + EPS);\n"
            "    for (uint c = lid; c < HIDDEN; c += G)\n"
            "        outr[c] = (T)((ACC)xr[c] * inv * (ACC)weight[c]);\n"
        )
        return lower_row_kernel(
            self, params, launch, device,
            KernelCode(kernel="rmsnorm",
                       args=("__global const T *restrict x",
                             "__global const T *restrict weight",
                             "__global T *restrict out"),
                       defines={"HIDDEN": f"{params.hidden}u",
                                "EPS": literal(params.eps, acc_type(params.dtype))},
                       body=body))

    def example(self, params: RmsnormParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        rows = 3
        x = rng.normal(0.0, 1.0, (rows, params.hidden)).astype(dtype)
        weight = rng.uniform(0.5, 1.5, params.hidden).astype(dtype)
        out = np.zeros_like(x)
        x64 = x.astype(np.float64)
        rms = np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + params.eps)
        want = x64 / rms * weight.astype(np.float64)
        return row_example("rmsnorm", params, rows, [x, weight, out], {2: want})
