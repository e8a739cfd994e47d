"""Helpers shared by the built-in families' code generators: parameter types, the
launch checks, the frame of a kernel's source (pragmas, ``#define``s, signature,
``reqd_work_group_size``), the scaffolding of the row-wise kernels (one work-group per
row, reduced with a tree in ``__local`` memory) and of the elementwise-style ones (one
work-item per element, surplus work-items guarded), and the examples' tolerances. Each
kernel's body stays in its family's module.

Every built-in family imports this module, so it is part of every one's build id
(``farm.families.buildid``: a built-in family's module and the farm modules it
imports), and a change here, which can change generated source, never serves an old
binary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, TypeAlias

import numpy as np
from pydantic import AfterValidator, Field

from farm.core.device import DeviceInfo
from farm.core.errors import ParameterError
from farm.core.model import LaunchSettings, Lowered
from farm.families.base import Example, KernelFamily, LocalMem

DType = Literal["float", "half", "double"]
#: the arguments of an :class:`~farm.families.base.Example`
Args: TypeAlias = list[np.ndarray | np.generic | LocalMem]

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
#: a compile-time row length (``cols``, ``hidden``)
RowLength = Annotated[int, Field(ge=1, le=1 << 20)]
#: elements per work-item of the elementwise families
Width = Literal[1, 2, 4, 8, 16]
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


def kernel_source(dtype: str, kernel: str, args: Sequence[str], body: str, *,
                  defines: Mapping[str, object] | None = None, prelude: str = "",
                  local_size: tuple[int, ...] | None = None) -> str:
    """A program of one kernel: the pragma ``dtype`` needs, a ``#define`` per entry of
    ``defines``, any other file-scope ``prelude`` (a constant table), then
    ``__kernel void kernel(args)`` with ``body`` (whole lines, indented four spaces)
    and, when ``local_size`` is given, its ``reqd_work_group_size``."""
    macros = "".join(f"#define {name} {value}\n" for name, value in (defines or {}).items())
    params = ",\n    ".join(args)
    return (f"{pragmas(dtype)}{macros}{prelude}"
            f"{reqd_wg(local_size)}__kernel void {kernel}(\n    {params})\n{{\n{body}}}\n")


# -- launch checks ----------------------------------------------------------------------


def check_fixed_group(family: KernelFamily[Any], dtype: str, launch: LaunchSettings,
                      device: DeviceInfo, shape: tuple[int, ...],
                      local_bytes: int) -> tuple[int, ...]:
    """The checks of a family whose parameters fix the work-group ``shape``: the element
    type, the launch's ``local_size`` (see :func:`fixed_local_size`), the device's
    work-group limits and its local memory (``local_bytes``). Returns the shape."""
    family.check_dtype(device, dtype)
    local = fixed_local_size(family.name, launch, shape)
    family.check_work_group(device, local)
    family.check_local_mem(device, local_bytes)
    return local


def check_any_group(family: KernelFamily[Any], dtype: str, launch: LaunchSettings,
                    device: DeviceInfo) -> tuple[int, ...] | None:
    """The checks of a family that runs with any work-group: the element type and, when
    the launch gives a ``local_size``, the device's limits. Returns that local size (to
    compile in) or ``None``."""
    family.check_dtype(device, dtype)
    if launch.local_size:
        family.check_work_group(device, launch.local_size)
    return launch.local_size


# -- row-wise kernels (reduce, softmax, rmsnorm, attention) -------------------------------


class RowParams(Protocol):
    """What the row-wise helpers read of a family's parameters."""

    @property
    def group_size(self) -> int: ...

    @property
    def dtype(self) -> str: ...


@dataclass(frozen=True)
class KernelCode:
    """The text of a one-kernel program: the kernel's name, its arguments, its body
    (whole lines, indented four spaces), a ``#define`` per entry of ``defines``, and any
    other file-scope ``prelude`` (a constant table)."""

    kernel: str
    args: Sequence[str]
    body: str
    defines: Mapping[str, object] | None = None
    prelude: str = ""


def lower_row_kernel(family: KernelFamily[Any], params: RowParams, launch: LaunchSettings,
                     device: DeviceInfo, code: KernelCode, *, extra_local: int = 0) -> Lowered:
    """A kernel that gives each row one work-group of ``group_size`` work-items, fixed
    with ``reqd_work_group_size``.

    The source defines ``T`` (the element type), ``ACC`` (the arithmetic type, see
    :func:`acc_type`), ``G`` (the group size) and ``defines``, and ``body`` follows the
    declarations of ``red`` (a ``__local ACC[G]`` for :func:`tree_reduce`), ``lid`` (the
    local id) and ``row`` (the group id, a ``size_t``) in ``code``. ``extra_local`` counts the
    ``ACC`` elements of ``__local`` memory the body declares besides ``red``.
    """
    g = params.group_size
    acc = acc_type(params.dtype)
    local = check_fixed_group(family, params.dtype, launch, device, (g,),
                              (g + extra_local) * SIZEOF[acc])
    head = ("    __local ACC red[G];\n"
            "    const uint lid = get_local_id(0);\n"
            "    const size_t row = get_group_id(0);\n")
    source = kernel_source(params.dtype, code.kernel, code.args, head + code.body,
                           defines={"T": params.dtype, "ACC": acc, "G": f"{g}u",
                                    **(code.defines or {})},
                           prelude=code.prelude, local_size=local)
    return Lowered(source=source, kernel_names=(code.kernel,))


def tree_reduce(value: str, result: str, combine: str, indent: str = "    ") -> str:
    """Work-group reduction of ``value`` through ``red``, in a :func:`lower_row_kernel`
    body.

    ``combine`` is an expression in ``{a}`` and ``{b}``, e.g. ``"{a} + {b}"``. The
    snippet leaves the group's result in the private ``const ACC result`` of every
    work-item, and ends with a barrier so the caller may reuse ``red`` at once. Every
    work-item of the group must reach the snippet (barriers).
    """
    step = combine.replace("{a}", "red[lid]").replace("{b}", "red[lid + s]")
    lines = [
        f"red[lid] = {value};",
        "barrier(CLK_LOCAL_MEM_FENCE);",
        "for (uint s = G / 2u; s > 0u; s >>= 1) {",
        f"    if (lid < s) red[lid] = {step};",
        "    barrier(CLK_LOCAL_MEM_FENCE);",
        "}",
        f"const ACC {result} = red[0];",
        "barrier(CLK_LOCAL_MEM_FENCE);",
    ]
    return "".join(f"{indent}{line}\n" for line in lines)


# -- elementwise-style kernels (elementwise_*, rotary, swiglu) -----------------------------


def lower_elementwise(family: KernelFamily[Any], dtype: str, launch: LaunchSettings,
                      device: DeviceInfo, code: KernelCode, *, count: str) -> Lowered:
    """A kernel of one work-item per ``count`` (an expression in the arguments) that
    runs with any work-group: ``code``'s body follows ``i`` (the global id, a ``size_t``)
    and the return of the surplus work-items of a rounded-up global size."""
    local = check_any_group(family, dtype, launch, device)
    head = ("    const size_t i = get_global_id(0);\n"
            f"    if (i >= {count}) return;\n")
    source = kernel_source(dtype, code.kernel, code.args, head + code.body,
                           defines=code.defines, prelude=code.prelude, local_size=local)
    return Lowered(source=source, kernel_names=(code.kernel,))


# -- examples ---------------------------------------------------------------------------


def checked_example(kernel: str, dtype: str, args: Args,
                    expected: dict[int, np.ndarray], global_size: tuple[int, ...],
                    local_size: tuple[int, ...] | None, *,
                    atol_scale: float = 1.0) -> Example:
    """An example compared with the :func:`tolerance` of ``dtype`` (``atol`` times
    ``atol_scale``, for sums whose rounding grows with the number of terms)."""
    rtol, atol = tolerance(dtype)
    return Example(kernel_name=kernel, args=args, global_size=global_size,
                   local_size=local_size, expected=expected, rtol=rtol,
                   atol=atol * atol_scale)


def row_example(kernel: str, params: RowParams, rows: int, args: Args,
                expected: dict[int, np.ndarray], *, atol_scale: float = 1.0) -> Example:
    """An example of a :func:`lower_row_kernel` kernel over ``rows`` rows."""
    g = params.group_size
    return checked_example(kernel, params.dtype, args, expected, (rows * g,), (g,),
                           atol_scale=atol_scale)


def elementwise_example(kernel: str, dtype: str, n: int, launch: LaunchSettings,
                        args: Args, expected: dict[int, np.ndarray]) -> Example:
    """An example of a :func:`lower_elementwise` kernel of ``n`` work-items, the global
    size rounded up to the launch's ``local_size`` when it gives one."""
    local = launch.local_size
    global_n = n if not local else round_up(n, local[0])
    return checked_example(kernel, dtype, args, expected, (global_n,), local)
