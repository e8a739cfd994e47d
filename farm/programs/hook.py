"""The hook: ``pyopencl.Program.build`` served by the farm, for the application's own
context and devices, with no change to the application's code.

:func:`install` replaces ``pyopencl.Program.build`` (the one entry point pyopencl.array,
clmath, reductions, scans, clrandom, reikna and loopy use) with a function that hands a
*source* build to :class:`~farm.programs.serve.ProgramServer` and passes everything else
through untouched: a program made from binaries or IL, a second ``build`` of a program
already built, an attribute access that made the program before ``build`` (pyopencl then
builds ``_prg`` itself), and every build the farm itself runs (its compiles run inside
:func:`~farm.compilation.compiling.farm_compiling`, so the hook never recurses into the
farm). ``Program.compile``, ``link_program`` and pyopencl's own binary cache are not
touched (none of the three libraries calls them on a build).

``Program.get_build_info`` is wrapped too: for a program the farm served from a binary it
answers ``LOG`` with the log of the source build that made the binary (a program made
from a binary has an empty log of its own); every other question goes to pyopencl.

At exit the process prints one line on stderr (:func:`~farm.programs.counts.summary_line`)
unless it runs under ``farm run``, which sums its processes' counts and prints one line
for the run (``FARM_RUN_DIR``, see :mod:`farm.programs.autoinstall`).
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.compilation.compiling import in_farm_compile
from farm.programs.counts import summary_line, write_json
from farm.programs.serve import ProgramServer

if TYPE_CHECKING:
    from farm.core.settings import Settings

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def install(settings: Settings | None = None, *, capture: Path | None = None,
            json_path: Path | None = None, summary: bool = True) -> ProgramServer:
    """Serve this process's ``pyopencl.Program.build`` calls from the farm.

    ``settings`` default to the ``FARM_*`` environment. ``capture`` writes every program
    built to that capture file at exit (``farm build`` reads it); ``json_path`` writes the
    counts there as JSON; ``summary`` prints the one summary line on stderr at exit.
    Idempotent: a second call returns the server already installed.
    """
    import pyopencl as cl

    with _LOCK:
        if "server" in _STATE:
            server: ProgramServer = _STATE["server"]
            return server
        log = None
        if capture:  # the capture's models load only when a capture is asked for
            from farm.programs.capture import CaptureLog

            log = CaptureLog()
        server = ProgramServer(settings, capture=log)
        original_build = cl.Program.build
        original_info = cl.Program.get_build_info

        @functools.wraps(original_build)
        def build(self: Any, options: Any = None, devices: Any = None,
                  cache_dir: Any = None) -> Any:
            state = self.__dict__
            if "_source" not in state or state.get("_prg") is not None or in_farm_compile():
                return original_build(self, options, devices, cache_dir)
            return server.build(self, options, devices,
                                lambda: original_build(self, options, devices, cache_dir))

        @functools.wraps(original_info)
        def get_build_info(self: Any, *args: Any, **kwargs: Any) -> Any:
            value = original_info(self, *args, **kwargs)
            logs = self.__dict__.get("_farm_build_logs")
            if logs is None:
                return value
            device = args[0] if args else kwargs.get("device")
            param = args[1] if len(args) > 1 else kwargs.get("param")
            if param == cl.program_build_info.LOG and device is not None:
                return logs.get(device.int_ptr, value)
            return value

        cl.Program.build = build  # type: ignore[method-assign]
        cl.Program.get_build_info = get_build_info  # type: ignore[method-assign]
        _STATE.update(server=server, build=original_build, info=original_info,
                      capture=capture, json=json_path, summary=summary)
        atexit.register(_at_exit)
        return server


def installed() -> ProgramServer | None:
    """The server of the installed hook, if any."""
    with _LOCK:
        server: ProgramServer | None = _STATE.get("server")
        return server


def uninstall() -> dict[str, int]:
    """Put pyopencl back as it was, close the server; returns its counts."""
    import pyopencl as cl

    with _LOCK:
        if "server" not in _STATE:
            return {}
        cl.Program.build = _STATE["build"]  # type: ignore[method-assign]
        cl.Program.get_build_info = _STATE["info"]  # type: ignore[method-assign]
        server: ProgramServer = _STATE.pop("server")
        _STATE.clear()
    atexit.unregister(_at_exit)
    counts = server.counts.snapshot()
    server.close()
    return counts


def _at_exit() -> None:
    """Report, write what was asked, close the records session (flushes it)."""
    with _LOCK:
        server: ProgramServer | None = _STATE.get("server")
        if server is None:
            return
        capture, json_path, summary = _STATE["capture"], _STATE["json"], _STATE["summary"]
    counts = server.counts.snapshot()
    try:
        if json_path is not None:
            write_json(json_path, counts)
        if capture is not None and server.capture is not None:
            from farm.programs.capture import write_capture

            write_capture(capture, server.capture.to_file())
    except OSError as exc:
        print(f"kernel-farm: error: {exc.filename or ''}: {exc.strerror or exc}",
              file=sys.stderr)
    try:
        server.close()
    except Exception as exc:  # records that cannot be written never fail the exit
        print(f"kernel-farm: warning: records not written ({exc})", file=sys.stderr)
    if summary and counts["programs"]:
        print(summary_line(counts), file=sys.stderr, flush=True)


def run_dir_paths(run_dir: Path) -> tuple[Path, Path]:
    """Where a process under ``farm run`` writes its counts and its capture."""
    pid = os.getpid()
    return run_dir / f"counts-{pid}.json", run_dir / f"capture-{pid}.json"
