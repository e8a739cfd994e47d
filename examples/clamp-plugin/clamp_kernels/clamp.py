"""``clamp``: ``out[i] = min(max(x[i], lo), hi)`` over ``n`` vectors of ``width``.

The bounds are parameters, so they are compile-time constants of the generated source
(one kernel per pair of bounds), as a family's shapes usually are.
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import Field, ValidationInfo, field_validator

from farm import DeviceInfo, Example, KernelFamily, LaunchSettings, Lowered, Params

#: a bound: any finite number (``allow_inf_nan`` refuses infinities and NaN)
Bound = Annotated[float, Field(allow_inf_nan=False)]


class ClampParams(Params):
    """Everything that changes the generated source. ``Params`` forbids unknown keys
    and makes the model immutable; a kernel id holds every field, defaults included."""

    lo: Bound
    hi: Bound
    dtype: Literal["float", "double"] = "float"
    width: Literal[1, 2, 4, 8] = 1

    @field_validator("hi")
    @classmethod
    def _above_lo(cls, hi: float, info: ValidationInfo) -> float:
        # raised as ValueError, reported as "clamp: parameter hi: must be above lo (...)"
        lo = info.data.get("lo")
        if lo is not None and hi <= lo:
            raise ValueError(f"must be above lo ({lo})")
        return hi


class Clamp(KernelFamily[ClampParams]):
    """Clamp every element of ``x`` into ``[lo, hi]``.

    Kernel ``clamp_values(x, out, n)``: ``x`` and ``out`` hold ``n`` vectors of
    ``width`` elements; launch ``n`` work-items (rounded up to the work-group, the
    kernel guards the surplus), any work-group.
    """

    name = "clamp"
    params_model = ClampParams
    #: what ``farm families check`` runs the example with
    example_params = ({"lo": -1.0, "hi": 1.0}, {"lo": 0.0, "hi": 6.0, "width": 4})

    def lower(self, params: ClampParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        # What this device cannot run is UnsupportedFeature (skipped, not a failure).
        self.check_dtype(device, params.dtype)
        attribute = ""
        if launch.local_size:  # compiled in: the launch shape is part of the kernel id
            self.check_work_group(device, launch.local_size)
            x, y, z = (*launch.local_size, 1, 1)[:3]
            attribute = f"__attribute__((reqd_work_group_size({x}, {y}, {z})))\n"
        t = params.dtype if params.width == 1 else f"{params.dtype}{params.width}"
        suffix = "f" if params.dtype == "float" else ""  # a bare literal is a double
        pragma = ("#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n"
                  if params.dtype == "double" else "")
        source = (
            f"{pragma}{attribute}"
            f"__kernel void clamp_values(__global const {t} *restrict x,\n"
            f"                           __global {t} *restrict out, const uint n)\n"
            "{\n"
            "    const size_t i = get_global_id(0);\n"
            "    if (i >= n) return;\n"
            f"    out[i] = clamp(x[i], ({t})({params.lo!r}{suffix}), "
            f"({t})({params.hi!r}{suffix}));\n"
            "}\n")
        return Lowered(source=source, kernel_names=("clamp_values",))

    def example(self, params: ClampParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        """Inputs on both sides of the bounds and numpy's answer (``np.clip``)."""
        n = 61  # vectors; not a multiple of a work-group, so the guard is exercised
        dtype = np.float32 if params.dtype == "float" else np.float64
        x = rng.uniform(params.lo - 2.0, params.hi + 2.0, n * params.width).astype(dtype)
        out = np.zeros_like(x)
        local = launch.local_size
        global_n = n if not local else -(-n // local[0]) * local[0]
        return Example(kernel_name="clamp_values", args=[x, out, np.uint32(n)],
                       global_size=(global_n,), local_size=local,
                       expected={1: np.clip(x.astype(np.float64), params.lo, params.hi)})
