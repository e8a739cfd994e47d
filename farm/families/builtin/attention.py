"""Single-head scaled dot-product attention ``softmax(Q K^T / sqrt(d)) V`` of
``[tokens, head_dim]`` matrices, optionally causal: one work-group per query row.

Online softmax (the FlashAttention recurrence), so no ``tokens``-sized score buffer
is needed and ``tokens`` can stay a launch argument: the group walks the keys in blocks
of ``group_size``. Per block each work-item scores one key against the query (held,
pre-scaled, in ``__local`` memory); a local tree gives the block maximum and the sum of
``exp(score - running max)``; then each work-item updates the output dimensions it owns
(``d = lid, lid + group_size, ...``), rescaling its running sums when the maximum grows.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import Field

from farm.core.device import DeviceInfo
from farm.core.model import LaunchSettings, Lowered
from farm.families.base import Example, KernelFamily, Params
from farm.families.builtin.common import (
    NUMPY,
    DType,
    GroupSize,
    KernelCode,
    acc_type,
    literal,
    lower_row_kernel,
    row_example,
    tree_reduce,
)


class AttentionParams(Params):
    """``head_dim`` is compile-time; ``tokens`` is a launch argument."""

    head_dim: int = Field(ge=1, le=1024)
    causal: bool = True
    group_size: GroupSize = 64
    dtype: DType = "float"


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                        causal: bool) -> np.ndarray:
    """numpy attention in float64."""
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    scores = q64 @ k64.T / math.sqrt(q.shape[1])
    if causal:
        scores = np.where(np.tril(np.ones_like(scores, dtype=bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v64


class Attention(KernelFamily[AttentionParams]):
    """``out[i] = sum_j softmax_j(q[i].k[j] / sqrt(d)) v[j]`` over ``j <= i`` if causal."""

    name = "attention"
    params_model = AttentionParams
    example_params = ({"head_dim": 16, "group_size": 16},)

    def lower(self, params: AttentionParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        d, g = params.head_dim, params.group_size
        kv_len = "(uint)row + 1u" if params.causal else "tokens"
        body = (
            "    __local ACC qs[D];\n"
            "    __local ACC ps[G];\n"
            "    for (uint d = lid; d < D; d += G) qs[d] = (ACC)q[row * D + d] * SCALE;\n"
            "    barrier(CLK_LOCAL_MEM_FENCE);\n"
            f"    const uint kv_len = {kv_len};\n"
            "    ACC m = (ACC)(-INFINITY);   /* running maximum of the scores */\n"
            "    ACC l = (ACC)0;             /* running sum of exp(score - m) */\n"
            "    ACC o[PER];                 /* this work-item's output dims, unnormalised */\n"
            "    for (uint t = 0; t < PER; ++t) o[t] = (ACC)0;\n"
            "    for (uint j0 = 0; j0 < kv_len; j0 += G) {\n"
            "        const uint j = j0 + lid;\n"
            "        ACC s = (ACC)(-INFINITY);\n"
            "        if (j < kv_len) {\n"
            "            s = (ACC)0;\n"
            "            __global const T *kj = k + (size_t)j * D;\n"
            "            for (uint d = 0; d < D; ++d) s += qs[d] * (ACC)kj[d];\n"
            "        }\n"
            f"{tree_reduce('s', 'block_max', 'fmax({a}, {b})', '        ')}"
            "        const ACC m_new = fmax(m, block_max);\n"
            "        const ACC p = j < kv_len ? exp(s - m_new) : (ACC)0;\n"
            "        ps[lid] = p;\n"
            f"{tree_reduce('p', 'block_sum', '{a} + {b}', '        ')}"
            "        const ACC corr = exp(m - m_new);   /* 0 on the first block */\n"
            "        l = l * corr + block_sum;\n"
            "        const uint len = min(G, kv_len - j0);\n"
            "        for (uint t = 0; t < PER; ++t) {\n"
            "            const uint d = lid + t * G;\n"
            "            if (d < D) {\n"
            "                ACC a = o[t] * corr;\n"
            "                for (uint jj = 0; jj < len; ++jj)\n"
            "                    a += ps[jj] * (ACC)v[(size_t)(j0 + jj) * D + d];\n"
            "                o[t] = a;\n"
            "            }\n"
            "        }\n"
            "        m = m_new;\n"
            "        barrier(CLK_LOCAL_MEM_FENCE);   /* ps is rewritten by the next block */\n"
            "    }\n"
            "    for (uint t = 0; t < PER; ++t) {\n"
            "        const uint d = lid + t * G;\n"
            "        if (d < D) out[row * D + d] = (T)(o[t] / l);\n"
            "    }\n"
        )
        return lower_row_kernel(
            self, params, launch, device,
            KernelCode(kernel="attention",
                       args=("__global const T *restrict q", "__global const T *restrict k",
                             "__global const T *restrict v", "__global T *restrict out",
                             "const uint tokens"),
                       defines={"D": f"{d}u", "PER": f"{-(-d // g)}u",
                                "SCALE": literal(1.0 / math.sqrt(d), acc_type(params.dtype))},
                       body=body),
            extra_local=d + g)  # qs and ps

    def example(self, params: AttentionParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        dtype = NUMPY[params.dtype]
        tokens = 37  # more than one block of keys for small group sizes, not a multiple
        shape = (tokens, params.head_dim)
        q, k, v = (rng.normal(0.0, 1.0, shape).astype(dtype) for _ in range(3))
        out = np.zeros(shape, dtype=dtype)
        want = attention_reference(q, k, v, params.causal)
        return row_example("attention", params, tokens, [q, k, v, out, np.uint32(tokens)],
                           {3: want})
