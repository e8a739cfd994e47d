"""Rotary position embedding (RoPE) of ``[tokens, heads, head_dim]`` at positions
``0..tokens-1``.

Half-split pairing (GPT-NeoX, Llama in Hugging Face transformers): element ``i`` of the
first half rotates with element ``i + head_dim/2`` by the angle ``pos * theta^(-2i /
head_dim)``. The inverse frequencies are computed here in float64 and baked into the
source as a constant table, so the device never evaluates ``pow`` per element. One
work-item rotates one pair; ``out`` may be ``x`` (in place), because every work-item
reads its pair before writing it.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field, field_validator

from farm.core.device import DeviceInfo
from farm.core.model import LaunchSettings, Lowered
from farm.families.base import Example, KernelFamily, Params
from farm.families.builtin.common import (
    NUMPY,
    DType,
    KernelCode,
    acc_type,
    elementwise_example,
    literal,
    lower_elementwise,
)


class RotaryParams(Params):
    """``head_dim``, ``heads`` and ``theta`` are compile-time; ``tokens`` is not."""

    head_dim: int = Field(ge=2, le=1024)
    heads: int = Field(ge=1, le=1024)
    theta: float = Field(default=10000.0, gt=0.0, allow_inf_nan=False)
    dtype: DType = "float"

    @field_validator("head_dim")
    @classmethod
    def _even(cls, value: int) -> int:
        if value % 2:
            raise ValueError(f"head_dim must be even (elements rotate in pairs), not {value}")
        return value

    def inv_freq(self) -> np.ndarray:
        """``theta^(-2i/head_dim)`` for each pair ``i``, in float64."""
        return np.asarray(self.theta, np.float64) ** (
            -np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)


def rope_reference(x: np.ndarray, params: RotaryParams) -> np.ndarray:
    """numpy RoPE of ``x[tokens, heads, head_dim]`` in float64."""
    x = x.astype(np.float64)
    half = params.head_dim // 2
    ang = np.arange(x.shape[0], dtype=np.float64)[:, None] * params.inv_freq()[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Rotary(KernelFamily[RotaryParams]):
    """RoPE; global size ``tokens * heads * head_dim / 2`` (rounded up to the group)."""

    name = "rotary"
    params_model = RotaryParams
    example_params = ({"head_dim": 16, "heads": 3},)

    def lower(self, params: RotaryParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        acc = acc_type(params.dtype)
        table = ",\n    ".join(
            ", ".join(literal(v, acc) for v in row)
            for row in np.array_split(params.inv_freq(), max(1, params.head_dim // 16)))
        return lower_elementwise(
            self, params.dtype, launch, device,
            KernelCode(kernel="rotary",
                       args=("__global const T *x", "__global T *out", "const uint tokens"),
                       defines={"T": params.dtype, "ACC": acc, "HALF": f"{params.head_dim // 2}u",
                                "HEADS": f"{params.heads}u"},
                       prelude=f"__constant ACC INV_FREQ[HALF] = {{\n    {table}\n}};\n",
                       body=(
                        "    const uint p = i % HALF;                /* the pair */\n"
                        "    const size_t row = i / HALF;            /* token * HEADS + head */\n"
                        "    const uint pos = (uint)(row / HEADS);\n"
                        "    const size_t base = row * (2 * HALF) + p;\n"
                        "    ACC c;\n"
                        "    const ACC s = sincos((ACC)pos * INV_FREQ[p], &c);\n"
                        "    const ACC x1 = (ACC)x[base], x2 = (ACC)x[base + HALF];\n"
                        "    out[base] = (T)(x1 * c - x2 * s);\n"
                        "    out[base + HALF] = (T)(x2 * c + x1 * s);\n")),
            count="(size_t)tokens * HEADS * HALF")

    def example(self, params: RotaryParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        tokens = 7
        x = rng.uniform(-1.0, 1.0, (tokens, params.heads, params.head_dim)).astype(dtype)
        out = np.zeros_like(x)
        want = rope_reference(x, params)
        pairs = tokens * params.heads * params.head_dim // 2
        return elementwise_example("rotary", params.dtype, pairs, launch,
                                   [x, out, np.uint32(tokens)], {1: want})
