"""Run a pyopencl application with its OpenCL calls timed: where does a process spend
what the driver does (a JIT, a program built from source, a driver-internal kernel)?

    python bench/cltrace.py TRACE.json APP.py [ARGS...]
    farm run -- python bench/cltrace.py TRACE.json APP.py [ARGS...]

The application runs as ``__main__`` in this process. Timed, each call on its own:

* ``build``: every ``pyopencl.Program.build`` the application makes (under ``farm run``
  the farm's hook: then ``served`` says whether the farm answered it);
* ``load``: every program the farm makes from stored binaries
  (``farm.programs.assemble._build``), with the kind of each binary: ``cubin`` (an ELF
  for a CUDA GPU: a copy), ``ptx`` (text the driver translates: a JIT), ``elf`` (another
  ELF: PoCL's code), ``pocl`` (a PoCL binary), ``other``;
* ``launch``: the first three launches of each kernel (``Kernel.__call__``);
* ``copy``, ``fill``: the first three ``enqueue_copy`` / ``enqueue_fill_buffer`` of each
  kind (NVIDIA's driver runs some of these with kernels of its own, which it may
  translate at their first use).

The trace (JSON) holds every timed call in order, with the application's line that made
it. ``bench/probe_served_start.py`` runs an application under several conditions with
this and prints the calls whose time depends on the drivers' caches.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import runpy
import sys
import time
from pathlib import Path
from typing import Any

_KERNEL = re.compile(r"__kernel\s+(?:__attribute__\s*\(\(.*?\)\)\s*)?void\s+(\w+)", re.S)
#: first launches timed per kernel, first copies or fills per kind
FIRST = 3


def binary_kind(data: bytes) -> str:
    """What the driver does with ``data`` at load: see the module docstring."""
    if data.startswith(b"\x7fELF"):
        machine = int.from_bytes(data[18:20], "little") if len(data) >= 20 else 0
        return "cubin" if machine == 190 else "elf"  # 190: EM_CUDA
    head = data[:4096]
    if b".version" in head and b".target" in head:
        return "ptx"
    if head.startswith(b"POCL") or b"pocl" in head[:64].lower():
        return "pocl"
    return "other"


class Trace:
    """The timed calls of this process, written as JSON at exit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = time.perf_counter()
        self.calls: list[dict[str, Any]] = []
        self.seen: dict[tuple[str, str], int] = {}

    def first(self, op: str, what: str) -> bool:
        """Whether this is one of the first :data:`FIRST` calls of ``op`` on ``what``."""
        n = self.seen.get((op, what), 0)
        self.seen[(op, what)] = n + 1
        return n < FIRST

    def add(self, op: str, what: str, seconds: float, **extra: Any) -> None:
        self.calls.append({"op": op, "what": what, "ms": round(seconds * 1000, 3),
                           "at_ms": round((time.perf_counter() - self.start) * 1000, 1),
                           "where": _app_line(), **extra})

    def write(self) -> None:
        self.path.write_text(json.dumps({"calls": self.calls, "total_ms": round(
            (time.perf_counter() - self.start) * 1000, 1)}))


def _app_line() -> str:
    """The innermost frame outside pyopencl, the farm and this file: who asked."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(p in name for p in ("/pyopencl/", "/farm/", "cltrace.py", "<frozen")):
            return f"{Path(name).name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def _kernel_name(source: Any) -> str:
    text = source.decode("utf-8", "replace") if isinstance(source, bytes) else str(source)
    found = _KERNEL.findall(text)
    return f"{found[0]}+{len(found) - 1}" if len(found) > 1 else (found[0] if found else "?")


def install(trace: Trace) -> None:
    """Wrap the calls the module docstring names (pyopencl imported here, so under
    ``farm run`` the farm's hook is already in place and is what gets wrapped)."""
    import pyopencl as cl

    build = cl.Program.build

    def timed_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = _kernel_name(self.__dict__.get("_source", ""))
        t = time.perf_counter()
        try:
            return build(self, *args, **kwargs)
        finally:
            trace.add("build", name, time.perf_counter() - t,
                      served="_farm_build_logs" in self.__dict__)

    cl.Program.build = timed_build  # type: ignore[method-assign]

    call = cl.Kernel.__call__

    def timed_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = str(self.function_name)
        if not trace.first("launch", name):
            return call(self, *args, **kwargs)
        t = time.perf_counter()
        try:
            return call(self, *args, **kwargs)
        finally:
            trace.add("launch", name, time.perf_counter() - t)

    cl.Kernel.__call__ = timed_call  # type: ignore[method-assign]

    for attr, op in (("enqueue_copy", "copy"), ("enqueue_fill_buffer", "fill")):
        _wrap_enqueue(cl, attr, op, trace)

    if os.environ.get("FARM_RUN_DIR"):  # under farm run: time the farm's loads too
        import farm.programs.assemble as assemble

        load = assemble._build

        def timed_load(ctx: Any, devices: Any, binaries: list[bytes], options: bytes) -> Any:
            t = time.perf_counter()
            try:
                return load(ctx, devices, binaries, options)
            finally:
                trace.add("load", ",".join(sorted({binary_kind(b) for b in binaries})),
                          time.perf_counter() - t, bytes=sum(len(b) for b in binaries))

        assemble._build = timed_load


def _wrap_enqueue(cl: Any, attr: str, op: str, trace: Trace) -> None:
    original = getattr(cl, attr)

    def timed(queue: Any, *args: Any, **kwargs: Any) -> Any:
        what = "-".join(type(a).__name__ for a in args[:2])
        if not trace.first(op, what):
            return original(queue, *args, **kwargs)
        t = time.perf_counter()
        try:
            return original(queue, *args, **kwargs)
        finally:
            trace.add(op, what, time.perf_counter() - t)

    setattr(cl, attr, timed)


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: cltrace.py TRACE.json APP.py [ARGS...]")
    trace = Trace(Path(sys.argv[1]))
    app = sys.argv[2]
    sys.argv = sys.argv[2:]
    sys.path[0] = os.path.dirname(os.path.abspath(app))  # as `python APP.py` has it
    install(trace)
    atexit.register(trace.write)
    runpy.run_path(app, run_name="__main__")


if __name__ == "__main__":
    main()
