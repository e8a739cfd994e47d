"""An application of the plugin: get a clamp kernel from the farm and run it.

    farm build clamp.toml        # compile the manifest's kernels into the store
    python run_clamp.py          # load one from the store, run it, compare with numpy

The loader finds the kernel in this machine's store (``FARM_HOME``); with
``on_miss="fail"`` it refuses to compile, which shows the build did its job (the
default, ``"compile"``, would compile a missing kernel here instead).
"""

from __future__ import annotations

import numpy as np
import pyopencl as cl

from loader import KernelLoader


def main() -> None:
    x = np.linspace(-3.0, 3.0, 1000, dtype=np.float32)
    with KernelLoader(on_miss="fail", label="clamp example") as loader:
        clamp = loader.kernel("clamp", {"lo": -1.0, "hi": 1.0})
        mf = cl.mem_flags
        bx = cl.Buffer(loader.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
        bout = cl.Buffer(loader.context, mf.WRITE_ONLY, x.nbytes)
        clamp(loader.queue, (x.size,), None, bx, bout, np.uint32(x.size))
        out = np.empty_like(x)
        cl.enqueue_copy(loader.queue, out, bout)
        from_store = loader.stats.local + loader.stats.remote
    if not np.array_equal(out, np.clip(x, -1.0, 1.0)):
        raise SystemExit("clamp differs from numpy")
    print(f"clamp matches numpy ({from_store} kernel loaded from the store)")


if __name__ == "__main__":
    main()
