"""Elementwise binary ops (add, sub, mul, div, max, min) over element types and vector
widths: the simplest family, and the pattern the others follow."""

from __future__ import annotations

from typing import Literal

import numpy as np

from farm.core.device import DeviceInfo
from farm.core.model import LaunchSettings, Lowered
from farm.families.base import Example, KernelFamily, Params
from farm.families.builtin.common import (
    NUMPY,
    DType,
    KernelCode,
    Width,
    elementwise_example,
    lower_elementwise,
    vec,
)

Op = Literal["add", "sub", "mul", "div", "max", "min"]

_EXPR = {"add": "a + b", "sub": "a - b", "mul": "a * b", "div": "a / b",
         "max": "fmax(a, b)", "min": "fmin(a, b)"}
_NUMPY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "max": np.maximum, "min": np.minimum}


class BinaryParams(Params):
    op: Op
    dtype: DType = "float"
    width: Width = 1


class ElementwiseBinary(KernelFamily[BinaryParams]):
    """``c[i] = op(a[i], b[i])`` over ``n`` vectors of ``width`` elements."""

    name = "elementwise_binary"
    params_model = BinaryParams
    example_params = ({"op": "mul", "width": 4},)

    def lower(self, params: BinaryParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        t = vec(params.dtype, params.width)
        return lower_elementwise(
            self, params.dtype, launch, device,
            KernelCode(kernel=f"binary_{params.op}",
                       args=(f"__global const {t} *restrict x", f"__global const {t} *restrict y",
                             f"__global {t} *restrict out", "const uint n"),
                       body=(f"    const {t} a = x[i];\n"
                             f"    const {t} b = y[i];\n"
                             f"    out[i] = {_EXPR[params.op]};\n")),
            count="n")

    def example(self, params: BinaryParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        n = 64
        x = rng.uniform(0.5, 2.0, n * params.width).astype(dtype)
        y = rng.uniform(0.5, 2.0, n * params.width).astype(dtype)
        out = np.zeros_like(x)
        want = _NUMPY[params.op](x.astype(np.float64), y.astype(np.float64))
        return elementwise_example(f"binary_{params.op}", params.dtype, n, launch,
                                   [x, y, out, np.uint32(n)], {2: want})
