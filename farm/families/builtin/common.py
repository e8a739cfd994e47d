"""Small helpers shared by the built-in families' code generators.

This module is part of every built-in family's build id (``depends_on``): a change here
can change generated source.
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import AfterValidator, Field

from farm.errors import ParameterError
from farm.model import LaunchSettings

DType = Literal["float", "half", "double"]

NUMPY: dict[str, type[np.generic]] = {"float": np.float32, "half": np.float16,
                                      "double": np.float64}


#: bytes per element, for local-memory budgets
SIZEOF: dict[str, int] = {"half": 2, "float": 4, "double": 8}


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


# -- parameter types ------------------------------------------------------------------


def _power_of_two(value: int) -> int:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{value} is not a power of two")
    return value


#: a work-group size for the kernels that reduce across one work-group (one row each)
GroupSize = Annotated[int, Field(ge=1, le=1024), AfterValidator(_power_of_two)]
#: a matmul tile edge
Tile = Annotated[int, Field(ge=4, le=128), AfterValidator(_power_of_two)]


# -- code generation ------------------------------------------------------------------


def acc_type(dtype: str) -> str:
    """The type arithmetic runs in: ``float`` for ``half`` (sums and exponentials in half
    lose too much), the element type otherwise."""
    return "float" if dtype == "half" else dtype


def convert(to: str, frm: str, expr: str) -> str:
    """``expr`` converted from type ``frm`` to ``to`` (``convert_T`` works for vectors,
    where a C cast does not); the expression itself when the types agree."""
    return expr if to == frm else f"convert_{to}({expr})"


def literal(value: float, ctype: str) -> str:
    """A floating literal of type ``ctype``. ``repr`` round-trips a Python float; an
    unsuffixed literal is a double, which a device without fp64 may refuse, so float
    (and half, which computes in float) gets the ``f`` suffix."""
    text = repr(float(value))
    if ctype == "double":
        return text
    return f"{text}f" if ctype == "float" else f"(({ctype}){text}f)"


def tree_reduce(buf: str, value: str, result: str, combine: str, group_size: int,
                ctype: str, indent: str = "    ") -> str:
    """Work-group reduction of ``value`` through the ``__local`` array ``buf``.

    ``combine`` is an expression in ``{a}`` and ``{b}``, e.g. ``"{a} + {b}"``. The
    snippet leaves the group's result in the private ``result`` (of type ``ctype``) of
    every work-item, and ends with a barrier so the caller may reuse ``buf`` at once.
    ``group_size`` must be a power of two, and the kernel must have defined ``lid``
    (its local id). Every work-item of the group must reach the snippet (barriers).
    """
    step = combine.replace("{a}", f"{buf}[lid]").replace("{b}", f"{buf}[lid + s]")
    lines = [
        f"{buf}[lid] = {value};",
        "barrier(CLK_LOCAL_MEM_FENCE);",
        f"for (uint s = {group_size // 2}u; s > 0u; s >>= 1) {{",
        f"    if (lid < s) {buf}[lid] = {step};",
        "    barrier(CLK_LOCAL_MEM_FENCE);",
        "}",
        f"const {ctype} {result} = {buf}[0];",
        "barrier(CLK_LOCAL_MEM_FENCE);",
    ]
    return "".join(f"{indent}{line}\n" for line in lines)


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value`` (a global size)."""
    return -(-value // multiple) * multiple


def fixed_local_size(family: str, launch: LaunchSettings,
                     shape: tuple[int, ...]) -> tuple[int, ...]:
    """The work-group shape a family's parameters fix. A launch that asks for another is
    a parameter error: the kernel is compiled with ``reqd_work_group_size(shape)``."""
    if launch.local_size is not None:
        want = (*launch.local_size, 1, 1)[:3]
        have = (*shape, 1, 1)[:3]
        if want != have:
            raise ParameterError(
                f"{family}: launch local_size {tuple(launch.local_size)} differs from the "
                f"work-group {shape} that its parameters fix")
    return shape
