"""Matrix transpose ``out[c, r] = x[r, c]`` of a fixed ``[rows, cols]`` matrix through a
``__local`` tile.

A ``tile x tile`` work-group reads a tile with consecutive work-items on consecutive
columns (coalesced), and writes the transposed tile the same way; the tile row is padded
by one element so the column-wise reads of the tile do not all hit one local bank.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from farm.core.device import DeviceInfo
from farm.core.model import LaunchArg, LaunchSettings, Lowered, ReadyLaunch
from farm.families.base import Example, KernelFamily, Params
from farm.families.builtin.common import (
    NUMPY,
    SIZEOF,
    DType,
    check_fixed_group,
    kernel_source,
    round_up,
)


class TransposeParams(Params):
    """Both shapes are compile-time; ``tile`` is the square work-group's edge."""

    rows: int = Field(ge=1, le=65536)
    cols: int = Field(ge=1, le=65536)
    tile: Literal[4, 8, 16, 32] = 16
    dtype: DType = "float"


class Transpose(KernelFamily[TransposeParams]):
    """``out[cols, rows] = x[rows, cols]^T``; work-group ``(tile, tile)``."""

    name = "transpose"
    params_model = TransposeParams
    example_params = ({"rows": 37, "cols": 45, "tile": 8},)

    def lower(self, params: TransposeParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        t = params.tile
        local = check_fixed_group(self, params.dtype, launch, device, (t, t),
                                  t * (t + 1) * SIZEOF[params.dtype])
        body = (
            "    __local T tile[TILE][TILE + 1];\n"
            "    const int lx = get_local_id(0), ly = get_local_id(1);\n"
            "    const int c0 = get_group_id(0) * TILE, r0 = get_group_id(1) * TILE;\n"
            "    int r = r0 + ly, c = c0 + lx;\n"
            "    if (r < ROWS && c < COLS) tile[ly][lx] = x[(size_t)r * COLS + c];\n"
            "    barrier(CLK_LOCAL_MEM_FENCE);\n"
            "    /* out row c0 + ly holds column c0 + ly of x; its entries are rows r0.. */\n"
            "    c = c0 + ly;\n"
            "    r = r0 + lx;\n"
            "    if (c < COLS && r < ROWS) out[(size_t)c * ROWS + r] = tile[lx][ly];\n"
        )
        source = kernel_source(params.dtype, "transpose",
                               ("__global const T *restrict x", "__global T *restrict out"),
                               body, local_size=local,
                               defines={"T": params.dtype, "ROWS": params.rows,
                                        "COLS": params.cols, "TILE": t})
        return Lowered(source=source, kernel_names=("transpose",))

    def example(self, params: TransposeParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        x = rng.uniform(-1.0, 1.0, (params.rows, params.cols)).astype(dtype)
        out = np.zeros((params.cols, params.rows), dtype=dtype)
        want = x.astype(np.float64).T.copy()
        t = params.tile
        # a transpose moves values without arithmetic: the result must be exact
        return Example(kernel_name="transpose", args=[x, out],
                       global_size=(round_up(params.cols, t), round_up(params.rows, t)),
                       local_size=(t, t), expected={1: want}, rtol=0.0, atol=0.0)

    def ready_launch(self, params: TransposeParams, launch: LaunchSettings) -> ReadyLaunch:
        """The example's launch from its sizes alone (no matrix is made)."""
        t, nbytes = params.tile, params.rows * params.cols * SIZEOF[params.dtype]
        return ReadyLaunch(kernel_name="transpose",
                           global_size=(round_up(params.cols, t), round_up(params.rows, t)),
                           local_size=(t, t),
                           args=(LaunchArg(kind="buffer", nbytes=nbytes),) * 2)
