"""The farm's built-in kernel library (one family per module, see ``base``)."""

from __future__ import annotations

from typing import Any

from farm.families.base import KernelFamily
from farm.families.builtin.elementwise_binary import ElementwiseBinary
from farm.families.builtin.elementwise_unary import ElementwiseUnary
from farm.families.builtin.reduce import Reduce

FAMILIES: list[type[KernelFamily[Any]]] = [
    ElementwiseBinary,
    ElementwiseUnary,
    Reduce,
]
