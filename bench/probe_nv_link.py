"""Can the CUDA JIT linker run without a CUDA context, and what does a retained primary
context cost a process at exit?

Three kinds of child process, 16 of each at once (as a pool's workers): each makes the
OpenCL context, builds one kernel and fetches its PTX, then ``none``: nothing more;
``primary``: links the PTX on the device's retained primary context (as the farm did);
``contextless``: links it with no context current and the target given explicitly
(``CU_JIT_TARGET``). Each prints its cubin's hash and says it is done; the parent
measures from the last "done" to the last child reaped (the exit's teardown).

    python bench/probe_nv_link.py [--processes 16]

Prints one JSON line (``PROBE_NV_LINK {...}``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = r'''
import ctypes, hashlib, sys, time
import pyopencl as cl
from farm.core.device import probe_devices, select_device
from farm.families import Registry
mode = sys.argv[1]
info = select_device(probe_devices(), "nvidia")
dev = cl.get_platforms()[info.platform_index].get_devices()[info.device_index]
ctx = cl.Context([dev])
fam = Registry.load([]).get("elementwise_binary")
lowered = fam.lower_id(fam.artifact_id({"op": "add"}), info)
prg = cl.Program(ctx, lowered.source).build(options=list(lowered.options))
ptx = bytes(prg.get_info(cl.program_info.BINARIES)[0])
digest, error = "", ""
if mode != "none":
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.cuInit(0) == 0
    if mode == "primary":
        pctx = ctypes.c_void_p()
        assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(pctx), 0) == 0
        assert lib.cuCtxSetCurrent(pctx) == 0
        opts = (ctypes.c_int * 0)()
        vals = (ctypes.c_void_p * 0)()
        n = 0
    else:
        major, minor = ctypes.c_int(), ctypes.c_int()
        lib.cuDeviceGetAttribute(ctypes.byref(major), 75, 0)
        lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, 0)
        opts = (ctypes.c_int * 1)(9)  # CU_JIT_TARGET
        vals = (ctypes.c_void_p * 1)(ctypes.c_void_p(major.value * 10 + minor.value))
        n = 1
    state = ctypes.c_void_p()
    t = time.perf_counter()
    rc = lib.cuLinkCreate_v2(ctypes.c_uint(n), opts, vals, ctypes.byref(state))
    if rc == 0:
        data = ptx + b"\0"
        rc = lib.cuLinkAddData_v2(state, 1, ctypes.c_char_p(data), ctypes.c_size_t(len(data)),
                                  ctypes.c_char_p(b"k.ptx"), 0, None, None)
    if rc == 0:
        cubin, size = ctypes.c_void_p(), ctypes.c_size_t()
        rc = lib.cuLinkComplete(state, ctypes.byref(cubin), ctypes.byref(size))
        if rc == 0:
            digest = hashlib.sha256(ctypes.string_at(cubin, size.value)).hexdigest()[:16]
    error = "" if rc == 0 else f"rc {rc}"
    link_ms = (time.perf_counter() - t) * 1000
else:
    link_ms = 0.0
print(f"DONE {digest} {error} {link_ms:.1f}", flush=True)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=16)
    args = parser.parse_args()
    out: dict[str, object] = {}
    for mode in ("none", "primary", "contextless"):
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE,
                                  text=True) for _ in range(args.processes)]
        lines = []
        for p in procs:
            assert p.stdout is not None
            lines.append(p.stdout.readline().strip())
        last_done = time.perf_counter()
        for p in procs:
            p.wait()
        out[mode] = {"exit_s": round(time.perf_counter() - last_done, 3),
                     "results": sorted(set(" ".join(x.split()[1:2] + x.split()[2:3])
                                           for x in lines)),
                     "link_ms": [x.split()[-1] for x in lines[:4]]}
    print("PROBE_NV_LINK " + json.dumps(out))


if __name__ == "__main__":
    main()
