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
from pydantic import Field, ValidationInfo, field_validator

from farm.device import DeviceInfo
from farm.families.base import Example, KernelFamily, Params
from farm.families.builtin.common import (
    NUMPY,
    DType,
    acc_type,
    convert,
    pragmas,
    reqd_wg,
    round_up,
    tolerance,
    vec,
)
from farm.model import LaunchSettings, Lowered


class SwigluParams(Params):
    """``hidden`` is compile-time (where ``up`` starts in a row); ``rows`` is not."""

    hidden: int = Field(ge=1, le=1 << 20)
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
    depends_on = ("farm.families.builtin.common",)

    def lower(self, params: SwigluParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        self.check_dtype(device, params.dtype)
        if launch.local_size:
            self.check_work_group(device, launch.local_size)
        t = vec(params.dtype, params.width)
        s = acc_type(params.dtype)
        a_t = vec(s, params.width)
        source = (
            f"{pragmas(params.dtype)}"
            f"#define S {s}\n#define HV {params.hidden // params.width}u\n"
            f"{reqd_wg(launch.local_size)}__kernel void swiglu(\n"
            f"    __global const {t} *restrict x, __global {t} *restrict out,\n"
            "    const uint rows)\n"
            "{\n"
            "    const size_t i = get_global_id(0);\n"
            "    if (i >= (size_t)rows * HV) return;\n"
            "    const size_t r = i / HV, c = i % HV;\n"
            f"    const {a_t} g = {convert(a_t, t, 'x[r * 2 * HV + c]')};\n"
            f"    const {a_t} u = {convert(a_t, t, 'x[r * 2 * HV + HV + c]')};\n"
            f"    out[i] = {convert(t, a_t, 'g / ((S)1 + exp(-g)) * u')};\n"
            "}\n"
        )
        return Lowered(source=source, kernel_names=("swiglu",))

    def example(self, params: SwigluParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        rows = 3
        x = rng.uniform(-3.0, 3.0, (rows, 2 * params.hidden)).astype(dtype)
        out = np.zeros((rows, params.hidden), dtype=dtype)
        x64 = x.astype(np.float64)
        gate, up = x64[:, :params.hidden], x64[:, params.hidden:]
        want = gate / (1.0 + np.exp(-gate)) * up
        rtol, atol = tolerance(params.dtype)
        n = rows * params.hidden // params.width
        local = launch.local_size
        global_n = n if not local else round_up(n, local[0])
        return Example(kernel_name="swiglu", args=[x, out, np.uint32(rows)],
                       global_size=(global_n,), local_size=local, expected={1: want},
                       rtol=rtol, atol=atol)
