"""Builds three programs, with a pause after the first: ``argv[1]`` is a folder where the
application writes ``ready`` after its first build and waits for ``go`` (a test stops or
freezes the store meanwhile). Prints the seconds the second and third builds took, as
JSON. Before the pause it compiles one program itself (pyopencl's C-level program, which
the farm does not serve), so that the compiler's start-up in this process is behind it
and the two builds differ by what the farm waited."""

import json
import sys
import time
from pathlib import Path

import pyopencl as cl

folder = Path(sys.argv[1])
ctx = cl.Context([cl.get_platforms()[0].get_devices()[0]])


def build(i: int) -> float:
    src = f"__kernel void outage_app_{i}(__global int *a) {{ a[get_global_id(0)] = {i}; }}"
    start = time.perf_counter()
    cl.Program(ctx, src).build()
    return time.perf_counter() - start


cl._cl._Program(ctx, "__kernel void warm(__global int *a) { a[0] = 1; }").build(b"", None)
build(0)
(folder / "ready").write_text("")
while not (folder / "go").exists():
    time.sleep(0.01)
print(json.dumps({"second": build(1), "third": build(2)}))
