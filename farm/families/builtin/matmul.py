"""Tiled matrix product ``C[m, n] = A[m, k] @ B[k, n]`` (row-major) through ``__local``
memory, with register blocking.

A work-group computes one ``tile_m x tile_n`` tile of C. Its ``(tile_m/wpt_m,
tile_n/wpt_n)`` work-items step through k ``tile_k`` at a time: together they copy a
``tile_m x tile_k`` tile of A and a ``tile_k x tile_n`` tile of B into local memory,
then each work-item accumulates its ``wpt_m x wpt_n`` outputs (rows ``wpt_m`` apart by
the group's height, columns likewise) from the local tiles in private registers. Every
global read and the final write are bounds-guarded, and out-of-range tile elements read
as zero, so m, n and k need not be multiples of the tiles.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, ValidationInfo, field_validator

from farm.core.device import DeviceInfo
from farm.core.model import LaunchArg, LaunchSettings, Lowered, ReadyLaunch
from farm.families.base import Example, KernelFamily, Params
from farm.families.builtin.common import (
    NUMPY,
    SIZEOF,
    DType,
    Tile,
    acc_type,
    check_fixed_group,
    checked_example,
    kernel_source,
    round_up,
)

Wpt = Literal[1, 2, 4, 8]


class MatmulParams(Params):
    """All three shapes are compile-time: a model build specializes per shape."""

    m: int = Field(ge=1, le=65536)
    n: int = Field(ge=1, le=65536)
    k: int = Field(ge=1, le=65536)
    tile_m: Tile = 16
    tile_n: Tile = 16
    tile_k: Tile = 16
    wpt_m: Wpt = 1
    wpt_n: Wpt = 1
    dtype: DType = "float"

    @field_validator("wpt_m", "wpt_n")
    @classmethod
    def _fits_tile(cls, value: int, info: ValidationInfo) -> int:
        """Each work-item's outputs must lie in its tile (both are powers of two, so
        ``wpt <= tile`` also makes the work-group shape whole)."""
        tile_field = "tile_m" if info.field_name == "wpt_m" else "tile_n"
        tile = info.data.get(tile_field)
        if tile is not None and value > tile:
            raise ValueError(f"{info.field_name}={value} exceeds {tile_field}={tile}")
        return value

    @property
    def local_size(self) -> tuple[int, int]:
        """The work-group shape: one work-item per ``wpt_m x wpt_n`` block of the tile."""
        return (self.tile_m // self.wpt_m, self.tile_n // self.wpt_n)

    @property
    def local_bytes(self) -> int:
        """Local memory of the A and B tiles."""
        return (self.tile_m * self.tile_k + self.tile_k * self.tile_n) * SIZEOF[self.dtype]


class Matmul(KernelFamily[MatmulParams]):
    """``C = A @ B`` for fixed m, n, k, one tile of C per work-group."""

    name = "matmul"
    params_model = MatmulParams
    example_params = ({"m": 37, "n": 45, "k": 29},)
    #: the tile shape is a choice; m, n, k and the element type are the problem
    tuning_params = ("tile_m", "tile_n", "tile_k", "wpt_m", "wpt_n")
    #: the medium manifest's common space: small to large tiles, some register blocking
    tuning_space = (
        {"tile_m": 16, "tile_n": 16, "tile_k": 16, "wpt_m": 1, "wpt_n": 1},
        {"tile_m": 32, "tile_n": 32, "tile_k": 16, "wpt_m": 2, "wpt_n": 2},
        {"tile_m": 32, "tile_n": 32, "tile_k": 8, "wpt_m": 4, "wpt_n": 4},
        {"tile_m": 64, "tile_n": 64, "tile_k": 16, "wpt_m": 4, "wpt_n": 4},
        {"tile_m": 16, "tile_n": 64, "tile_k": 16, "wpt_m": 1, "wpt_n": 4},
        {"tile_m": 64, "tile_n": 32, "tile_k": 8, "wpt_m": 4, "wpt_n": 2},
    )

    def lower(self, params: MatmulParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        p = params
        local = check_fixed_group(self, p.dtype, launch, device, p.local_size, p.local_bytes)
        body = (
            "    __local T at[TM][TK];\n"
            "    __local T bt[TK][TN];\n"
            "    const int lm = get_local_id(0);\n"
            "    const int ln = get_local_id(1);\n"
            "    const int tid = ln * RTM + lm;  /* the hardware order: coalesced tile loads */\n"
            "    const int m0 = get_group_id(0) * TM;\n"
            "    const int n0 = get_group_id(1) * TN;\n"
            "    ACC acc[WPTM][WPTN];\n"
            "    for (int wm = 0; wm < WPTM; ++wm)\n"
            "        for (int wn = 0; wn < WPTN; ++wn) acc[wm][wn] = (ACC)0;\n"
            "    for (int k0 = 0; k0 < K; k0 += TK) {\n"
            "        for (int i = tid; i < TM * TK; i += THREADS) {\n"
            "            const int r = i / TK, q = i % TK;\n"
            "            const int gr = m0 + r, gq = k0 + q;\n"
            "            at[r][q] = (gr < M && gq < K) ? a[(size_t)gr * K + gq] : (T)0;\n"
            "        }\n"
            "        for (int i = tid; i < TK * TN; i += THREADS) {\n"
            "            const int r = i / TN, q = i % TN;\n"
            "            const int gr = k0 + r, gq = n0 + q;\n"
            "            bt[r][q] = (gr < K && gq < N) ? b[(size_t)gr * N + gq] : (T)0;\n"
            "        }\n"
            "        barrier(CLK_LOCAL_MEM_FENCE);\n"
            "        for (int kk = 0; kk < TK; ++kk) {\n"
            "            ACC bv[WPTN];\n"
            "            for (int wn = 0; wn < WPTN; ++wn) bv[wn] = (ACC)bt[kk][ln + wn * RTN];\n"
            "            for (int wm = 0; wm < WPTM; ++wm) {\n"
            "                const ACC av = (ACC)at[lm + wm * RTM][kk];\n"
            "                for (int wn = 0; wn < WPTN; ++wn) acc[wm][wn] += av * bv[wn];\n"
            "            }\n"
            "        }\n"
            "        barrier(CLK_LOCAL_MEM_FENCE);\n"
            "    }\n"
            "    for (int wm = 0; wm < WPTM; ++wm) {\n"
            "        const int r = m0 + lm + wm * RTM;\n"
            "        for (int wn = 0; wn < WPTN; ++wn) {\n"
            "            const int q = n0 + ln + wn * RTN;\n"
            "            if (r < M && q < N) c[(size_t)r * N + q] = (T)acc[wm][wn];\n"
            "        }\n"
            "    }\n"
        )
        defines = {"T": p.dtype, "ACC": acc_type(p.dtype), "M": p.m, "N": p.n, "K": p.k,
                   "TM": p.tile_m, "TN": p.tile_n, "TK": p.tile_k,
                   "WPTM": p.wpt_m, "WPTN": p.wpt_n, "RTM": "(TM / WPTM)",
                   "RTN": "(TN / WPTN)", "THREADS": "(RTM * RTN)"}
        source = kernel_source(p.dtype, "matmul", ("__global const T *restrict a",
                                                   "__global const T *restrict b",
                                                   "__global T *restrict c"),
                               body, defines=defines, local_size=local)
        return Lowered(source=source, kernel_names=("matmul",))

    def example(self, params: MatmulParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        m, n, k = params.m, params.n, params.k
        if m * n * k <= SAMPLED_ABOVE:
            a = rng.uniform(-1.0, 1.0, (m, k)).astype(dtype)
            b = rng.uniform(-1.0, 1.0, (k, n)).astype(dtype)
            want = a.astype(np.float64) @ b.astype(np.float64)
            sampled: dict[int, np.ndarray] = {}
        else:  # the whole reference would take numpy seconds to minutes: sample it
            a = _uniform(rng, (m, k), dtype)
            b = _uniform(rng, (k, n), dtype)
            flat = np.unique(rng.integers(0, m * n, size=min(m * n, SAMPLES)))
            want = _sampled_product(a, b, flat)
            sampled = {2: flat}
        c = np.zeros((m, n), dtype=dtype)
        # rounding grows with the number of terms
        example = checked_example("matmul", params.dtype, [a, b, c], {2: want},
                                  _global_size(params), params.local_size,
                                  atol_scale=max(1.0, float(np.sqrt(k))))
        example.sampled = sampled
        return example

    def ready_launch(self, params: MatmulParams, launch: LaunchSettings) -> ReadyLaunch:
        """The example's launch from its sizes alone: the example of a large product
        builds its matrices and a float64 reference (a second, for the largest)."""
        size = SIZEOF[params.dtype]
        buffers = (params.m * params.k, params.k * params.n, params.m * params.n)
        return ReadyLaunch(kernel_name="matmul", global_size=_global_size(params),
                           local_size=params.local_size,
                           args=tuple(LaunchArg(kind="buffer", nbytes=n * size)
                                      for n in buffers))


#: products of more multiply-adds than this are checked at :data:`SAMPLES` elements
SAMPLED_ABOVE = 1 << 24
SAMPLES = 4096


def _uniform(rng: np.random.Generator, shape: tuple[int, int],
             dtype: type[np.generic]) -> np.ndarray:
    """Uniform in [-1, 1) drawn in single precision (a large operand in double would
    take twice its memory for nothing)."""
    values = rng.random(shape, dtype=np.float32)
    values *= 2.0
    values -= 1.0
    return values.astype(dtype, copy=False)


def _sampled_product(a: np.ndarray, b: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """``(a @ b).reshape(-1)[flat]`` in double precision, from those elements' rows and
    columns only, a few at a time (bounded memory whatever k)."""
    n = b.shape[1]
    rows, cols = np.divmod(flat, n)
    out = np.empty(len(flat), dtype=np.float64)
    step = max(1, (1 << 22) // max(1, a.shape[1]))
    for i in range(0, len(flat), step):
        r, q = rows[i:i + step], cols[i:i + step]
        out[i:i + step] = np.einsum("ik,ki->i", a[r].astype(np.float64),
                                    b[:, q].astype(np.float64))
    return out


def _global_size(params: MatmulParams) -> tuple[int, int]:
    """One work-item per ``wpt_m x wpt_n`` block of C, in whole tiles."""
    return (round_up(params.m, params.tile_m) // params.wpt_m,
            round_up(params.n, params.tile_n) // params.wpt_n)
