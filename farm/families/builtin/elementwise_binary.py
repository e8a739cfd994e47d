"""Elementwise binary ops (add, sub, mul, div, max, min) over element types and vector
widths: the simplest family, and the pattern the others follow."""

from __future__ import annotations

from typing import Literal

import numpy as np

from farm.device import DeviceInfo
from farm.families.base import Example, KernelFamily, Params
from farm.families.builtin.common import NUMPY, DType, pragmas, reqd_wg, tolerance, vec
from farm.model import LaunchSettings, Lowered

Op = Literal["add", "sub", "mul", "div", "max", "min"]

_EXPR = {"add": "a + b", "sub": "a - b", "mul": "a * b", "div": "a / b",
         "max": "fmax(a, b)", "min": "fmin(a, b)"}
_NUMPY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "max": np.maximum, "min": np.minimum}


class BinaryParams(Params):
    op: Op
    dtype: DType = "float"
    width: Literal[1, 2, 4, 8, 16] = 1


class ElementwiseBinary(KernelFamily[BinaryParams]):
    """``c[i] = op(a[i], b[i])`` over ``n`` vectors of ``width`` elements."""

    name = "elementwise_binary"
    params_model = BinaryParams
    depends_on = ("farm.families.builtin.common",)

    def lower(self, params: BinaryParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        self.check_dtype(device, params.dtype)
        if launch.local_size:
            self.check_work_group(device, launch.local_size)
        t = vec(params.dtype, params.width)
        expr = _EXPR[params.op]
        source = (
            f"{pragmas(params.dtype)}"
            f"{reqd_wg(launch.local_size)}__kernel void binary_{params.op}(\n"
            f"    __global const {t} *restrict x, __global const {t} *restrict y,\n"
            f"    __global {t} *restrict out, const uint n)\n"
            "{\n"
            "    const size_t i = get_global_id(0);\n"
            "    if (i >= n) return;\n"
            f"    const {t} a = x[i];\n"
            f"    const {t} b = y[i];\n"
            f"    out[i] = {expr};\n"
            "}\n"
        )
        return Lowered(source=source, kernel_names=(f"binary_{params.op}",))

    def example(self, params: BinaryParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        n = 64
        x = rng.uniform(0.5, 2.0, n * params.width).astype(dtype)
        y = rng.uniform(0.5, 2.0, n * params.width).astype(dtype)
        out = np.zeros_like(x)
        want = _NUMPY[params.op](x.astype(np.float64), y.astype(np.float64))
        rtol, atol = tolerance(params.dtype)
        local = launch.local_size
        global_n = n if not local else -(-n // local[0]) * local[0]
        return Example(kernel_name=f"binary_{params.op}", args=[x, y, out, np.uint32(n)],
                       global_size=(global_n,), local_size=local, expected={2: want},
                       rtol=rtol, atol=atol)
