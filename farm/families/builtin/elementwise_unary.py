"""Elementwise unary activations and math (relu, gelu, silu, exp, tanh, neg, sqrt,
sigmoid) over element types and vector widths.

Arithmetic runs in :func:`~farm.families.builtin.common.acc_type` (float for half), so a
half kernel rounds once, on the store, as a framework's fused activation would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    acc_type,
    convert,
    elementwise_example,
    literal,
    lower_elementwise,
    vec,
)

Op = Literal["relu", "gelu", "silu", "exp", "tanh", "neg", "sqrt", "sigmoid"]

#: OpenCL expressions in ``a`` (a vector of the arithmetic type) and ``S`` (its scalar)
_EXPR = {
    "relu": "fmax(a, (S)0)",
    # exact GELU (erf form), the default of PyTorch's nn.GELU
    "gelu": "(S)0.5f * a * ((S)1 + erf(a * SQRT1_2))",
    "silu": "a / ((S)1 + exp(-a))",
    "exp": "exp(a)",
    "tanh": "tanh(a)",
    "neg": "-a",
    "sqrt": "sqrt(a)",
    "sigmoid": "(S)1 / ((S)1 + exp(-a))",
}

_erf = np.vectorize(math.erf, otypes=[np.float64])

_NUMPY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": lambda x: np.maximum(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "exp": np.exp,
    "tanh": np.tanh,
    "neg": np.negative,
    "sqrt": np.sqrt,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
}


class UnaryParams(Params):
    """Which function, element type and vector width (elements per work-item)."""

    op: Op
    dtype: DType = "float"
    width: Width = 1


class ElementwiseUnary(KernelFamily[UnaryParams]):
    """``out[i] = op(x[i])`` over ``n`` vectors of ``width`` elements."""

    name = "elementwise_unary"
    params_model = UnaryParams
    example_params = ({"op": "gelu"},)

    def lower(self, params: UnaryParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        t = vec(params.dtype, params.width)
        s = acc_type(params.dtype)
        a_t = vec(s, params.width)
        return lower_elementwise(
            self, params.dtype, launch, device,
            KernelCode(kernel=f"unary_{params.op}",
                       args=(f"__global const {t} *restrict x", f"__global {t} *restrict out",
                             "const uint n"),
                       defines={"S": s, "SQRT1_2": literal(math.sqrt(0.5), s)},
                       body=(f"    const {a_t} a = {convert(a_t, t, 'x[i]')};\n"
                             f"    out[i] = {convert(t, a_t, _EXPR[params.op])};\n")),
            count="n")

    def example(self, params: UnaryParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        n = 67  # vectors; deliberately not a multiple of a typical work-group
        lo = 0.1 if params.op == "sqrt" else -3.0
        x = rng.uniform(lo, 3.0, n * params.width).astype(dtype)
        out = np.zeros_like(x)
        want = _NUMPY[params.op](x.astype(np.float64))
        return elementwise_example(f"unary_{params.op}", params.dtype, n, launch,
                                   [x, out, np.uint32(n)], {1: want})
