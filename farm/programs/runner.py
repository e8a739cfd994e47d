"""``farm run``: an application's command with the hook in every Python process it starts.

The command runs as a child with ``farm/programs/shim`` first on ``PYTHONPATH`` and a
private ``FARM_RUN_DIR`` (see :mod:`farm.programs.autoinstall`); each of its Python
processes writes its counts (and its capture) there at exit, and the run's result is
their sum: one summary line for the whole run, however many processes it had. The
command's exit status is the run's.

``PYTHONHASHSEED`` is set to 0 when the environment does not set it: some code
generators emit their source in set or dict order (loopy 2025.2 orders the conditions of
a loop by hash: ``if (-1 + m >= 0 && -1 + l >= 0)`` in one process, the other way round
in the next, whenever its own disk cache misses), so with a random seed every node would
compile its own variant of the same program. A seed the user set (``random`` included)
is kept.

``farm run``'s own process is paid on every run, before the command starts and after it
ends, so it imports almost nothing (no ``subprocess``, ``tempfile`` or ``pathlib``: 20
to 30 ms between them, more on a busy machine): the command is started with
``posix_spawn`` from a private folder made with ``os.mkdir``, and what the run's
processes wrote is read once it ends.
"""

from __future__ import annotations

import os
import sys

from farm.core.errors import FarmError, InputError
from farm.core.runenv import RUN_CAPTURE, RUN_DIR
from farm.programs.autoinstall import shim_folder
from farm.programs.counts import KEYS, RunCounts, read_process, summary_line, write_json

#: typing.TYPE_CHECKING without importing typing (nor dataclasses below): this module is
#: ``farm run``'s own process, and what it imports is paid on every run
TYPE_CHECKING = False
if TYPE_CHECKING:  # the capture's models (pydantic) load only when a capture is asked for
    from os import PathLike

    from farm.programs.capture import CaptureFile


class RunResult:
    """The command's exit status, the counts of all its processes, their capture."""

    __slots__ = ("capture", "counts", "returncode", "unclosed", "unreadable")

    def __init__(self, returncode: int, counts: dict[str, int], capture: CaptureFile | None,
                 unreadable: int = 0, unclosed: int = 0) -> None:
        self.returncode = returncode
        self.counts = counts
        self.capture = capture
        #: counts or captures of processes that could not be read (killed mid-write)
        self.unreadable = unreadable
        #: served processes that ended without closing (killed): counted up to their last
        #: build, nothing harvested or captured at their end
        self.unclosed = unclosed

    def __repr__(self) -> str:
        return (f"RunResult(returncode={self.returncode}, counts={self.counts}, "
                f"unreadable={self.unreadable}, unclosed={self.unclosed})")


def run_served(command: list[str], *, capture: bool = False) -> RunResult:
    """Run ``command`` with the hook armed; wait for it; gather what its processes wrote."""
    if not command:
        raise InputError("no command to run: farm run -- COMMAND [ARGS...]")
    run_dir = _private_folder()
    try:
        env = dict(os.environ)
        env[RUN_DIR] = run_dir
        env[RUN_CAPTURE] = "1" if capture else ""
        env.setdefault("PYTHONHASHSEED", "0")  # see the module docstring
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (shim_folder(), env.get("PYTHONPATH", "")) if p)
        _prove_ahead(command, capture)
        try:
            pid = os.posix_spawnp(command[0], command, env)
        except FileNotFoundError:
            raise InputError(f"command not found: {command[0]}") from None
        except PermissionError:
            raise InputError(f"command not executable: {command[0]}") from None
        except OSError as exc:
            raise FarmError(f"cannot run {command[0]}: {exc.strerror or exc}") from None
        code = os.waitstatus_to_exitcode(_wait(pid))
        code = code if code >= 0 else 128 - code
        return _gather(run_dir, code, capture)
    finally:
        _remove(run_dir)


def _prove_ahead(command: list[str], capture: bool) -> None:
    """The prover ahead of the application, started before the command
    (:func:`farm.programs.ahead.start_before`); never an error of the run's."""
    try:
        from farm.programs.ahead import start_before

        start_before(command, capture)
    except Exception as exc:  # the application starts it itself, or is proven later
        print(f"kernel-farm: warning: the prover ahead is not started ({exc})",
              file=sys.stderr)


def _private_folder() -> str:
    """A new folder of this user's only, under ``TMPDIR`` (``tempfile``'s rule without
    its import)."""
    base = os.environ.get("TMPDIR") or "/tmp"
    for _ in range(100):
        path = os.path.join(base, f"farm-run-{os.getpid()}-{os.urandom(6).hex()}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return path
    raise FarmError(f"{base}: cannot make a private folder for the run")


def _wait(pid: int) -> int:
    """The command's wait status. Interrupted (Ctrl-C), the command is killed as
    ``subprocess.run`` would, and the interruption goes on."""
    try:
        return os.waitpid(pid, 0)[1]
    except BaseException:
        import signal

        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass
        raise


def _remove(folder: str) -> None:
    """The run's folder and the files its processes left there."""
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    import shutil

                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
        os.rmdir(folder)
    except OSError:
        pass  # a leftover in the temporary folder is no failure of the run


def run_and_report(command: list[str], json_path: str | PathLike[str] | None,
                   capture: str | PathLike[str] | None) -> int:
    """``farm run``: run ``command`` served, print the run's line (and what was written)
    on stderr, write ``json_path`` and ``capture`` if given; the command's exit status.
    :class:`~farm.core.errors.FarmError` for what cannot be run."""
    for target in (json_path, capture):
        if target is not None and not os.path.isdir(
                os.path.dirname(os.path.abspath(target))):
            raise FarmError(f"{os.fspath(target)}: its folder does not exist")
    result = run_served(command, capture=capture is not None)
    print(summary_line(result.counts), file=sys.stderr, flush=True)
    if result.unreadable:
        print(f"kernel-farm: warning: {result.unreadable} process(es) left counts or a "
              "capture that could not be read (killed while writing?)", file=sys.stderr)
    if result.unclosed:
        print(f"kernel-farm: warning: {result.unclosed} served process(es) ended before "
              "the farm could close them (killed?): counted up to their last build, their "
              "end not harvested", file=sys.stderr)
    if json_path is not None:
        write_json(json_path, result.counts)
    if capture is not None and result.capture is not None:
        from pathlib import Path

        from farm.programs.capture import write_capture

        write_capture(Path(capture), result.capture)
        print(f"kernel-farm: captured {len(result.capture.programs)} program(s) for "
              f"{', '.join(result.capture.fingerprints()) or 'no device'} in {capture}",
              file=sys.stderr)
    if result.returncode:
        name = signal_name(result.returncode)
        if name:
            print(f"kernel-farm: the command was killed by {name}", file=sys.stderr)
    return result.returncode


def _files(run_dir: str, prefix: str) -> list[str]:
    """``prefix*.json`` files of the run's folder, in order."""
    return sorted(os.path.join(run_dir, name) for name in os.listdir(run_dir)
                  if name.startswith(prefix) and name.endswith(".json"))


def _gather(run_dir: str, code: int, capture: bool) -> RunResult:
    total = RunCounts()
    unreadable = unclosed = 0
    for path in _files(run_dir, "counts-"):
        try:
            counts, closed = read_process(path)
        except (OSError, ValueError):
            unreadable += 1
            continue
        total.add(counts)
        unclosed += not closed
    parts: list[CaptureFile] = []
    if capture:
        from pathlib import Path

        from farm.programs.capture import CaptureError, merge, read_capture

        for name in _files(run_dir, "capture-"):
            try:
                parts.append(read_capture(Path(name)))
            except CaptureError:
                unreadable += 1
    counts = total.snapshot()
    return RunResult(returncode=code, counts={k: counts[k] for k in KEYS},
                     capture=merge(parts) if capture else None, unreadable=unreadable,
                     unclosed=unclosed)


def signal_name(code: int) -> str:
    """``SIGKILL`` for an exit status of 137 (128 + 9); "" when it is no signal's."""
    if code <= 128:
        return ""
    import signal

    try:
        return signal.Signals(code - 128).name
    except ValueError:
        return ""
