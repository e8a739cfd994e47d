"""The farm's built-in kernel library (one family per module, see ``base``).

The parameters of each family are documented in ``docs/FAMILIES.md``.
"""

from __future__ import annotations

from typing import Any

from farm.families.base import KernelFamily
from farm.families.builtin.attention import Attention
from farm.families.builtin.elementwise_binary import ElementwiseBinary
from farm.families.builtin.elementwise_unary import ElementwiseUnary
from farm.families.builtin.matmul import Matmul
from farm.families.builtin.reduce import Reduce
from farm.families.builtin.rmsnorm import Rmsnorm
from farm.families.builtin.rotary import Rotary
from farm.families.builtin.softmax import Softmax
from farm.families.builtin.swiglu import Swiglu
from farm.families.builtin.transpose import Transpose

FAMILIES: list[type[KernelFamily[Any]]] = [
    ElementwiseBinary,
    ElementwiseUnary,
    Reduce,
    Softmax,
    Rmsnorm,
    Matmul,
    Transpose,
    Rotary,
    Attention,
    Swiglu,
]
