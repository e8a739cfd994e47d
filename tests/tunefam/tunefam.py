"""A tunable kernel family for the tuning tests; never in the shipped registry.

``twice`` writes ``y = 2 x`` over ``n`` floats, in one of four ways (its tuning
parameter): ``plain``; ``slow`` (right, but recomputes each element 64 times);
``lazy`` (returns at once: the fastest by far, and wrong, so that a tuning that did not
check values first would choose it); ``huge`` (a work-group larger than any CPU device
allows: unsupported). Register it with ``FARM_FAMILY_MODULES='["tunefam"]'`` and this
folder on ``PYTHONPATH``.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from farm.core.model import Lowered
from farm.families.base import Example, KernelFamily, Params

Way = Literal["plain", "slow", "lazy", "huge"]
#: the work-group of ``huge``: over the 4096 work-items PoCL's CPU drivers allow
HUGE_GROUP = 8192


class TwiceParams(Params):
    n: int = 4096
    way: Way = "plain"


class Twice(KernelFamily[TwiceParams]):
    name = "twice"
    params_model = TwiceParams
    tuning_params = ("way",)
    tuning_space = ({"way": "plain"}, {"way": "slow"})

    def lower(self, params: TwiceParams, launch: Any, device: Any) -> Lowered:
        if params.way == "huge":
            self.check_work_group(device, (HUGE_GROUP,))
        body = {
            "plain": "y[i] = 2.0f * x[i];",
            "slow": "float s = 0.0f; for (int r = 0; r < 64; ++r) s += x[i] * (r + 1);"
                    " y[i] = s / 1040.0f;",
            "lazy": "return;",
            "huge": "y[i] = 2.0f * x[i];",
        }[params.way]
        return Lowered(source=(
            f"/* twice {params.way} */\n"
            "__kernel void twice(__global const float *x, __global float *y) {\n"
            f"    const int i = get_global_id(0);\n    if (i >= {params.n}) return;\n"
            f"    {body}\n}}\n"), kernel_names=("twice",))

    def example(self, params: TwiceParams, launch: Any, rng: Any) -> Example:
        x = rng.uniform(-1.0, 1.0, params.n).astype(np.float32)
        y = np.zeros(params.n, dtype=np.float32)
        group = HUGE_GROUP if params.way == "huge" else None
        size = -(-params.n // HUGE_GROUP) * HUGE_GROUP if group else params.n
        return Example("twice", [x, y], (size,), (group,) if group else None,
                       {1: 2.0 * x.astype(np.float64)}, rtol=1e-5, atol=1e-5)


FAMILIES = [Twice]
