"""Small helpers shared by the built-in families' code generators.

This module is part of every built-in family's build id (``depends_on``): a change here
can change generated source.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

DType = Literal["float", "half", "double"]

NUMPY: dict[str, type[np.generic]] = {"float": np.float32, "half": np.float16,
                                      "double": np.float64}


def pragmas(dtype: str) -> str:
    """Extension pragmas an element type needs."""
    if dtype == "half":
        return "#pragma OPENCL EXTENSION cl_khr_fp16 : enable\n"
    if dtype == "double":
        return "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n"
    return ""


def vec(dtype: str, width: int) -> str:
    """OpenCL vector type name: ``float`` for width 1, ``float4`` for 4."""
    return dtype if width == 1 else f"{dtype}{width}"


def tolerance(dtype: str) -> tuple[float, float]:
    """(rtol, atol) for comparing against numpy in float64."""
    return {"half": (2e-2, 2e-2), "float": (1e-4, 1e-5), "double": (1e-10, 1e-12)}[dtype]


def reqd_wg(local_size: tuple[int, ...] | None) -> str:
    """The ``reqd_work_group_size`` attribute for a fixed work-group shape."""
    if not local_size:
        return ""
    dims = (*local_size, 1, 1)[:3]
    return f"__attribute__((reqd_work_group_size({dims[0]}, {dims[1]}, {dims[2]}))) "
