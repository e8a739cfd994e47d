"""Launching a family's :class:`~farm.families.base.Example` on a device.

Used by the numeric tests (every family against numpy), the demo, the README's
application example and ``farm families check``
(:func:`farm.compilation.family_check.check_family`); it is the one place that turns an
``Example`` into buffers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from farm.families.base import Example, LocalMem

if TYPE_CHECKING:
    import pyopencl as cl


def run_example(queue: cl.CommandQueue, kernel: cl.Kernel,
                example: Example) -> dict[int, np.ndarray]:
    """Run ``kernel`` with ``example``'s arguments; return the outputs it expects."""
    import pyopencl as cl

    ctx = queue.context
    mf = cl.mem_flags
    bufs: dict[int, cl.Buffer] = {}
    args: list[Any] = []
    for i, arg in enumerate(example.args):
        if isinstance(arg, LocalMem):
            args.append(cl.LocalMemory(arg.nbytes))
        elif isinstance(arg, np.ndarray):
            host = np.ascontiguousarray(arg)
            buf = cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=host)
            bufs[i] = buf
            args.append(buf)
        else:
            args.append(arg)
    kernel.set_args(*args)
    cl.enqueue_nd_range_kernel(queue, kernel, example.global_size, example.local_size)
    out: dict[int, np.ndarray] = {}
    for i in example.expected:
        src = example.args[i]
        assert isinstance(src, np.ndarray)
        result = np.empty_like(src)
        cl.enqueue_copy(queue, result, bufs[i])
        out[i] = result
    queue.finish()
    return out


def check_example(outputs: dict[int, np.ndarray], example: Example) -> list[str]:
    """Mismatches between ``outputs`` and the expected values, as readable lines."""
    problems = []
    for i, want in example.expected.items():
        got = outputs[i]
        if i in example.sampled:  # checked at these elements only
            got = got.reshape(-1)[example.sampled[i]]
        if not np.allclose(got.astype(np.float64), want.astype(np.float64),
                           rtol=example.rtol, atol=example.atol):
            err = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
            problems.append(f"argument {i}: max abs error {err:.3g}")
    return problems
