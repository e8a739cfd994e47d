"""RMS normalisation of rows with a learned scale: one work-group per row.

``out = x / sqrt(mean(x^2) + eps) * weight`` (as in Llama). The sum of squares is
reduced across the work-group with a tree in ``__local`` memory, in float for half
inputs; ``hidden`` and ``eps`` are baked into the source.
"""

from __future__ import annotations

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
    literal,
    pragmas,
    reqd_wg,
    tolerance,
    tree_reduce,
)
from farm.model import LaunchSettings, Lowered


class RmsnormParams(Params):
    """``hidden`` and ``eps`` are compile-time; ``rows`` is the launch's."""

    hidden: int = Field(ge=1, le=1 << 20)
    group_size: GroupSize = 64
    eps: float = Field(default=1e-6, gt=0.0, le=1.0, allow_inf_nan=False)
    dtype: DType = "float"


class Rmsnorm(KernelFamily[RmsnormParams]):
    """``out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight``."""

    name = "rmsnorm"
    params_model = RmsnormParams
    depends_on = ("farm.families.builtin.common",)

    def lower(self, params: RmsnormParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        self.check_dtype(device, params.dtype)
        g = params.group_size
        local = fixed_local_size(self.name, launch, (g,))
        self.check_work_group(device, local)
        acc = acc_type(params.dtype)
        self.check_local_mem(device, g * SIZEOF[acc])
        source = (
            f"{pragmas(params.dtype)}"
            f"#define T {params.dtype}\n#define ACC {acc}\n"
            f"#define HIDDEN {params.hidden}u\n#define G {g}u\n"
            f"#define EPS {literal(params.eps, acc)}\n"
            f"{reqd_wg(local)}__kernel void rmsnorm(\n"
            "    __global const T *restrict x, __global const T *restrict weight,\n"
            "    __global T *restrict out)\n"
            "{\n"
            "    __local ACC red[G];\n"
            "    const uint lid = get_local_id(0);\n"
            "    const size_t row = get_group_id(0);\n"
            "    __global const T *xr = x + row * HIDDEN;\n"
            "    __global T *outr = out + row * HIDDEN;\n"
            "    ACC ss = (ACC)0;\n"
            "    for (uint c = lid; c < HIDDEN; c += G) {\n"
            "        const ACC v = (ACC)xr[c];\n"
            "        ss += v * v;\n"
            "    }\n"
            f"{tree_reduce('red', 'ss', 'total', '{a} + {b}', g, 'ACC')}"
            "    const ACC inv = rsqrt(total / (ACC)HIDDEN + EPS);\n"
            "    for (uint c = lid; c < HIDDEN; c += G)\n"
            "        outr[c] = (T)((ACC)xr[c] * inv * (ACC)weight[c]);\n"
            "}\n"
        )
        return Lowered(source=source, kernel_names=("rmsnorm",))

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
        rtol, atol = tolerance(params.dtype)
        g = params.group_size
        return Example(kernel_name="rmsnorm", args=[x, weight, out],
                       global_size=(rows * g,), local_size=(g,), expected={2: want},
                       rtol=rtol, atol=atol)
