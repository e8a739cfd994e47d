"""The SwiGLU gate of a fused MLP: ``out = silu(gate) * up``.

Input is the output of a fused gate/up projection, ``x[rows, 2 * hidden]`` with the
gate in the first half of each row and ``up`` in the second (the layout of vLLM's
``silu_and_mul``); output is ``[rows, hidden]``. ``hidden`` is baked in, so a row's two
halves are found without an argument; ``width`` elements move per work-item, which
needs ``hidden`` to be a multiple of ``width``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import ValidationInfo, field_validator

from farm.core.device import DeviceInfo
from farm.core.model import LaunchSettings, Lowered
from farm.families.base import Example, KernelFamily, Params
from farm.families.builtin.common import (
    NUMPY,
    DType,
    KernelCode,
    RowLength,
    acc_type,
    convert,
    elementwise_example,
    lower_elementwise,
    vec,
)


class SwigluParams(Params):
    """``hidden`` is compile-time (where ``up`` starts in a row); ``rows`` is not."""

    hidden: RowLength
    dtype: DType = "float"
    width: Literal[1, 2, 4] = 1

    @field_validator("width")
    @classmethod
    def _divides_hidden(cls, value: int, info: ValidationInfo) -> int:
        hidden = info.data.get("hidden")
        if hidden is not None and hidden % value:
            raise ValueError(f"width={value} does not divide hidden={hidden}")
        return value


class Swiglu(KernelFamily[SwigluParams]):
    """``out[r, c] = silu(x[r, c]) * x[r, hidden + c]``."""

    name = "swiglu"
    params_model = SwigluParams
    example_params = ({"hidden": 96, "width": 4},)

    def lower(self, params: SwigluParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        t = vec(params.dtype, params.width)
        s = acc_type(params.dtype)
        a_t = vec(s, params.width)
        return lower_elementwise(
            self, params.dtype, launch, device,
            KernelCode(kernel="swiglu",
                       args=(f"__global const {t} *restrict x", f"__global {t} *restrict out",
                             "const uint rows"),
                       defines={"S": s, "HV": f"{params.hidden // params.width}u"},
                       body=("    const size_t r = i / HV, c = i % HV;\n"
                             f"    const {a_t} g = {convert(a_t, t, 'x[r * 2 * HV + c]')};\n"
                             f"    const {a_t} u = {convert(a_t, t, 'x[r * 2 * HV + HV + c]')};\n"
                             f"    out[i] = {convert(t, a_t, 'g / ((S)1 + exp(-g)) * u')};\n")),
            count="(size_t)rows * HV")

    def example(self, params: SwigluParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        rows = 3
        x = rng.uniform(-3.0, 3.0, (rows, 2 * params.hidden)).astype(dtype)
        out = np.zeros((rows, params.hidden), dtype=dtype)
        x64 = x.astype(np.float64)
        gate, up = x64[:, :params.hidden], x64[:, params.hidden:]
        want = gate / (1.0 + np.exp(-gate)) * up
        return elementwise_example("swiglu", params.dtype, rows * params.hidden // params.width,
                                   launch, [x, out, np.uint32(rows)], {1: want})
