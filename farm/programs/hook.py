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

What a process pays before its first build is what it imports: :func:`arm` (``farm
run``'s way in) imports nothing of the program server; a build first tries the quick
path (:mod:`farm.programs.quick`: a stored binary, read and loaded with the standard
library), and the server, its settings, models and store clients load at the first build
the quick path declines.

Every process counts (``farm run``): the counts are written when the hook is installed
and after every build (:func:`~farm.programs.counts.write_process`), and closed when the
process ends, which for a ``multiprocessing`` child (fork, spawn, forkserver, a
``concurrent.futures`` process pool) is not Python's exit: such a child ends with
``os._exit`` after its ``threading`` shutdown, or by the SIGTERM its pool's
``terminate()`` sends (``with Pool() as p:``). So the hook also closes at that shutdown
and on that SIGTERM (in children only: a main process keeps SIGTERM as it was), and a
forked child starts with counts, files and a server of its own (the parent's sockets,
SQLite connections and threads are never used across a fork).

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
from farm.core.errors import FarmError
from farm.programs.counts import RunCounts, summary_line, write_json, write_process
from farm.programs.plain import build_plain, unavailable, warn, why

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import FrameType

    import pyopencl as cl

    from farm.core.settings import Settings
    from farm.programs.ahead import Ahead
    from farm.programs.generated import Generated
    from farm.programs.quick import BuildOptions, QuickPath
    from farm.programs.serve import PlainBuild, ProgramServer

_LOCK = threading.Lock()
#: pyopencl's own functions, while the hook is installed
_ORIGINAL: dict[str, Any] = {}
#: seconds a child's SIGTERM waits for the farm to close before the child dies
SIGTERM_CLOSE_S = 5.0


class Hooked:
    """What the hook serves with in this process; a forked child gets a new one."""

    def __init__(self, settings: Settings | None, *, capture: Path | None,
                 json_path: Path | None, run_dir: Path | None, summary: bool,
                 server: ProgramServer | None = None, quick: bool = False,
                 ahead: Ahead | None = None) -> None:
        self.settings = settings
        self.capture = capture
        self.json_path = json_path
        #: ``farm run``'s folder: this process's counts file is named for its pid there
        self.run_dir = run_dir
        self.summary = summary
        self.counts = server.counts if server is not None else RunCounts()
        self._server = server
        self._quick_wanted = quick
        self._quick: QuickPath | None = None
        #: the prover ahead of this application (farm.programs.ahead), if one runs
        self.ahead = ahead
        from farm.programs.plan import Built

        #: what this process built, for the application's plan (farm.programs.plan)
        self.plan = Built()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        #: set when the close starts (at most one close runs), and when it is done
        self.closed = False
        self._done = threading.Event()
        #: the store stopped answering: every later build is the plain way
        self.broken = False
        self._warned: set[str] = set()
        self._generated: Generated | None = None
        if run_dir is not None:
            self.json_path, self.capture = _run_dir_files(run_dir, capture is not None)

    @property
    def server(self) -> ProgramServer:
        """The program server, made (and its modules imported) on first use."""
        with self._lock:
            if self._server is None:
                from farm.core.gcpause import cyclic_gc_paused

                with cyclic_gc_paused():  # pydantic, settings (farm.core.gcpause)
                    import logging

                    from farm.programs.serve import ProgramServer

                    # the hook speaks for the farm in an application, one warning line
                    # at a time; the farm's own log lines reach the application's
                    # handlers if it has some, and stderr never (logging's last resort)
                    logging.getLogger("farm").addHandler(logging.NullHandler())

                    log = None
                    if self.capture is not None:
                        from farm.programs.capture import CaptureLog

                        log = CaptureLog()
                    self._server = ProgramServer(self.settings, capture=log,
                                                 counts=self.counts)
                    self._server.built = self.plan.add
                    if self._quick is not None:
                        self._server.adopt(self._quick.observed())
            return self._server

    @property
    def started(self) -> ProgramServer | None:
        with self._lock:
            return self._server

    def quick(self) -> QuickPath | None:
        if not self._quick_wanted or self.capture is not None:
            return None
        with self._lock:
            if self._quick is None:
                from farm.programs.quick import QuickPath

                self._quick = QuickPath(self.counts, lambda: self.server.store,
                                        self._warn_once)
                self._quick.ahead = self.ahead
                self._quick.built = self.plan.add
            return self._quick

    def serve_generated(self) -> None:
        """Serve pyopencl's and loopy's generated code as the farm serves binaries
        (:mod:`farm.programs.generated`), where the quick path reads the store."""
        quick = self.quick()
        if quick is None or quick.config.declined or not quick.config.reads_generated:
            return
        from farm.programs.generated import Generated

        self._generated = Generated(quick.read_generated, self._generated_writer)
        self._generated.install()

    def _generated_writer(self) -> Callable[[str, str, bytes], None] | None:
        """How generated code is stored at the end (the server's store), unless the farm
        became unavailable."""
        if self.broken or self._quick is None or not self._quick.config.writes_generated:
            return None
        from farm.core.keys import Namespace
        from farm.core.model import Artifact, Key
        from farm.programs.generated import GENERATED_FAMILY, GENERATED_NAMESPACE

        store = self.server.store
        ns = Namespace.for_fingerprint(GENERATED_NAMESPACE)

        def write(key: str, build_id: str, data: bytes) -> None:
            try:
                store.put(ns, Artifact.create(Key(id_hash=key, build_id=build_id),
                                              GENERATED_FAMILY, data, key))
            except (OSError, ValueError, FarmError) as exc:
                self._warn_once(f"generated code not stored ({why(exc)})")

        return write

    def _warn_once(self, text: str) -> None:
        """A warning of the quick path's harvest, once; none after the farm became
        unavailable (its one line said so)."""
        with self._lock:
            if self.broken or text in self._warned:
                return
            self._warned.add(text)
        warn(text)

    def build(self, program: cl.Program, options: BuildOptions,
              devices: Sequence[cl.Device] | None, plain: PlainBuild) -> cl.Program:
        try:
            if self.broken:
                self.counts.bump("programs")
                return build_plain(plain, self.counts)
            quick = self.quick()
            if quick is not None:
                from farm.programs.rows import Unavailable

                try:
                    if quick.build(program, options, devices):
                        return program
                except Unavailable as exc:  # said here, once: every later build
                    self.broken = True           # is the plain way, with no server
                    warn(unavailable(why(exc.cause)))
                    self.counts.bump("programs")
                    return build_plain(plain, self.counts)
            server = self.server
            try:
                return server.build(program, options, devices, plain)
            finally:
                self.broken = bool(server.broken)
        finally:
            self.write_counts()

    def write_counts(self, closed: bool = False, wait_s: float | None = None) -> None:
        """This process's counts file under ``farm run`` (see the module docstring)."""
        if self.run_dir is None or self.json_path is None:
            return
        if not self._write_lock.acquire(timeout=-1 if wait_s is None else wait_s):
            return
        try:
            write_process(self.json_path, self.counts.snapshot(), closed)
        except OSError:
            pass  # the run's folder is gone (farm run killed): nothing to tell
        finally:
            self._write_lock.release()

    def close(self) -> None:
        """Write what was asked, store what PoCL's launches made, close the records
        session (flushes it); the summary line. Once."""
        with self._lock:
            first, self.closed = not self.closed, True
        if not first:  # another thread closes (SIGTERM during the exit): wait for it,
            self._done.wait(SIGTERM_CLOSE_S)  # as the process may end when this returns
            return
        try:
            self._close()
        finally:
            self._done.set()

    def _close(self) -> None:
        try:
            self._close_parts()
        finally:
            self.write_counts(closed=True, wait_s=SIGTERM_CLOSE_S)
            counts = self.counts.snapshot()
            if self.summary and counts["programs"]:
                print(summary_line(counts), file=sys.stderr, flush=True)

    def _close_parts(self) -> None:
        """The last harvest, generated code, the capture, the server: each on its own (a
        failure of one never keeps the others, nor the counts, from being written)."""
        for part in (self._quick, self._generated):
            if part is not None:
                try:
                    part.close()  # the last harvest; the generated code's store
                except Exception as exc:  # the exit goes on: said once
                    self._warn_once(f"the farm could not finish ({why(exc)})")
        server = self.started
        counts = self.counts.snapshot()
        if server is not None and not self.broken:
            self.plan.store(lambda: server.store, self._warn_once)
        try:
            if self.capture is not None and server is not None and \
                    server.capture is not None:
                from farm.programs.capture import write_capture

                write_capture(self.capture, server.capture.to_file(self.plan.app))
            if self.json_path is not None and self.run_dir is None:
                write_json(self.json_path, counts)
        except OSError as exc:
            print(f"kernel-farm: error: {exc.filename or ''}: {exc.strerror or exc}",
                  file=sys.stderr)
        try:
            if server is not None:
                server.close()
        except Exception as exc:  # records that cannot be written never fail the exit
            print(f"kernel-farm: warning: records not written ({exc})", file=sys.stderr)

    def forked(self) -> Hooked:
        """The state of a child forked from this process: the same configuration, new
        counts, files and server (this one's is the parent's, never used here)."""
        return Hooked(self.settings, capture=self.capture, json_path=self.json_path,
                      run_dir=self.run_dir, summary=self.summary,
                      quick=self._quick_wanted, ahead=self.ahead)


_HOOKED: Hooked | None = None
#: the states of parents this process was forked from: kept, never closed (their
#: connections and threads belong to the parent)
_PARENTS: list[Hooked] = []
_FORK_HANDLER = False


def install(settings: Settings | None = None, *, capture: Path | None = None,
            json_path: Path | None = None, summary: bool = True) -> ProgramServer:
    """Serve this process's ``pyopencl.Program.build`` calls from the farm.

    ``settings`` default to the ``FARM_*`` environment. ``capture`` writes every program
    built to that capture file at exit (``farm build`` reads it); ``json_path`` writes the
    counts there as JSON; ``summary`` prints the one summary line on stderr at exit.
    Idempotent: a second call returns the server already installed.
    """
    with _LOCK:
        if _HOOKED is None:
            _patch(Hooked(settings, capture=capture, json_path=json_path, run_dir=None,
                          summary=summary))
        hooked = _HOOKED
    assert hooked is not None
    return hooked.server


def arm(run_dir: Path, capture: bool, ahead: Ahead | None = None) -> None:
    """Install the hook as ``farm run`` does (:mod:`farm.programs.autoinstall`): counts
    (and a capture) into ``run_dir``; the quick path first (waiting for ``ahead``, the
    prover ahead of the application, where it proves a program); nothing of the program
    server imported until a build needs it."""
    with _LOCK:
        if _HOOKED is None:
            # under a run folder the capture's file is named there (per process):
            # ``capture`` only says whether one is wanted
            _patch(Hooked(None, capture=run_dir if capture else None, json_path=None,
                          run_dir=run_dir, summary=False, quick=True,
                          ahead=ahead))
            assert _HOOKED is not None
            _HOOKED.write_counts()
            _HOOKED.serve_generated()
            _if_multiprocessing_child()


def _patch(hooked: Hooked) -> None:
    """Put ``hooked`` in place and pyopencl's two functions under the hook (``_LOCK``
    held)."""
    global _HOOKED, _FORK_HANDLER
    import pyopencl as cl

    original_build = cl.Program.build
    original_info = cl.Program.get_build_info

    @functools.wraps(original_build)
    def build(self: Any, options: Any = None, devices: Any = None,
              cache_dir: Any = None) -> Any:
        state = self.__dict__
        current = _HOOKED
        if current is None or "_source" not in state or state.get("_prg") is not None \
                or in_farm_compile():
            return original_build(self, options, devices, cache_dir)
        return current.build(self, options, devices,
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
    _ORIGINAL.update(build=original_build, info=original_info)
    _HOOKED = hooked
    atexit.register(_at_exit)
    if not _FORK_HANDLER:
        os.register_at_fork(after_in_child=_forked)
        _FORK_HANDLER = True


def installed() -> ProgramServer | None:
    """The server of the installed hook, if any."""
    with _LOCK:
        hooked = _HOOKED
    return hooked.server if hooked is not None else None


def uninstall() -> dict[str, int]:
    """Put pyopencl back as it was, close the server; returns its counts."""
    global _HOOKED
    import pyopencl as cl

    with _LOCK:
        hooked, _HOOKED = _HOOKED, None
        if hooked is None:
            return {}
        cl.Program.build = _ORIGINAL.pop("build")  # type: ignore[method-assign]
        cl.Program.get_build_info = _ORIGINAL.pop("info")  # type: ignore[method-assign]
    atexit.unregister(_at_exit)
    counts = hooked.counts.snapshot()
    server = hooked.started
    if server is not None:
        server.close()
    return counts


def _at_exit() -> None:
    hooked = _HOOKED
    if hooked is not None:
        hooked.close()


def _forked() -> None:
    """In a child just forked: a state of its own (see :meth:`Hooked.forked`)."""
    global _HOOKED, _LOCK
    _LOCK = threading.Lock()  # another thread of the parent may have held it
    if _HOOKED is None:
        return
    _PARENTS.append(_HOOKED)
    _HOOKED = _HOOKED.forked()
    _HOOKED.write_counts()
    util = sys.modules.get("multiprocessing.util")
    if util is not None:  # runs in the child's bootstrap, once it is a Process
        util.register_after_fork(_HOOKED, lambda _: _if_multiprocessing_child())


def _if_multiprocessing_child() -> None:
    """In a ``multiprocessing`` child: close at its ``threading`` shutdown (it ends with
    ``os._exit``, so ``atexit`` never runs) and on its pool's SIGTERM."""
    process = sys.modules.get("multiprocessing.process")
    if process is None or process.current_process().name == "MainProcess":
        return
    register = getattr(threading, "_register_atexit", None)  # Python >= 3.9
    if register is not None:
        try:
            register(_at_exit)
        except RuntimeError:  # already shutting down
            return
    _watch_sigterm()


def _watch_sigterm() -> None:
    """Close on the SIGTERM a pool's ``terminate()`` sends, then end as that signal would.

    A Python handler alone is not enough: CPython runs it on the main thread, and a pool
    worker's main thread waits in a lock (its queue's) that only a signal delivered to
    that very thread interrupts, while the kernel may deliver it to any thread (PoCL's,
    the farm's). So the handler does nothing itself; what CPython writes for every
    signal to the wakeup file descriptor wakes a thread of ours, which closes (bounded:
    the main thread may hold a lock the close needs) and ends the process with the
    status SIGTERM gives. Not installed where SIGTERM has a handler already or a wakeup
    descriptor is in use (an event loop's)."""
    import signal

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    if signal.set_wakeup_fd(write, warn_on_full_buffer=False) != -1:
        signal.set_wakeup_fd(-1)  # someone's own: left as it was, and SIGTERM too
        os.close(read)
        os.close(write)
        return
    signal.signal(signal.SIGTERM, _sigterm_noted)
    threading.Thread(target=_on_sigterm, args=(read,), name="kernel-farm SIGTERM",
                     daemon=True).start()


def _sigterm_noted(signum: int, frame: FrameType | None) -> None:
    """SIGTERM's Python handler: the work is :func:`_on_sigterm`'s, on its own thread."""


def _on_sigterm(read: int) -> None:
    """Wait for SIGTERM on the wakeup descriptor; then close and end the process."""
    import signal

    while signal.SIGTERM not in os.read(read, 64):
        pass
    hooked = _HOOKED
    if hooked is not None and not hooked.closed:  # else: closing, and ending anyway
        closer = threading.Thread(target=_at_exit, name="kernel-farm close", daemon=True)
        closer.start()
        closer.join(SIGTERM_CLOSE_S)
        os._exit(128 + signal.SIGTERM)


def _run_dir_files(run_dir: Path, capture: bool) -> tuple[Path, Path | None]:
    """Where a process under ``farm run`` writes its counts and its capture."""
    pid = os.getpid()
    return run_dir / f"counts-{pid}.json", run_dir / f"capture-{pid}.json" if capture \
        else None

