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
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from farm.core.errors import FarmError, InputError
from farm.programs.autoinstall import RUN_CAPTURE, RUN_DIR, shim_dir
from farm.programs.counts import KEYS, RunCounts, read_process, summary_line, write_json

#: typing.TYPE_CHECKING without importing typing (nor dataclasses below): this module is
#: ``farm run``'s own process, and what it imports is paid on every run
TYPE_CHECKING = False
if TYPE_CHECKING:  # the capture's models (pydantic) load only when a capture is asked for
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
    with tempfile.TemporaryDirectory(prefix="farm-run-") as run_dir:
        env = dict(os.environ)
        env[RUN_DIR] = run_dir
        env[RUN_CAPTURE] = "1" if capture else ""
        env.setdefault("PYTHONHASHSEED", "0")  # see the module docstring
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(shim_dir()), env.get("PYTHONPATH", "")) if p)
        try:
            proc = subprocess.run(command, env=env, check=False)
        except FileNotFoundError:
            raise InputError(f"command not found: {command[0]}") from None
        except PermissionError:
            raise InputError(f"command not executable: {command[0]}") from None
        except OSError as exc:
            raise FarmError(f"cannot run {command[0]}: {exc.strerror or exc}") from None
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        return _gather(Path(run_dir), code, capture)


def run_and_report(command: list[str], json_path: Path | None, capture: Path | None) -> int:
    """``farm run``: run ``command`` served, print the run's line (and what was written)
    on stderr, write ``json_path`` and ``capture`` if given; the command's exit status.
    :class:`~farm.core.errors.FarmError` for what cannot be run."""
    for target in (json_path, capture):
        if target is not None and not target.parent.is_dir():
            raise FarmError(f"{target}: its folder does not exist")
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
        from farm.programs.capture import write_capture

        write_capture(capture, result.capture)
        print(f"kernel-farm: captured {len(result.capture.programs)} program(s) for "
              f"{', '.join(result.capture.fingerprints()) or 'no device'} in {capture}",
              file=sys.stderr)
    if result.returncode:
        name = signal_name(result.returncode)
        if name:
            print(f"kernel-farm: the command was killed by {name}", file=sys.stderr)
    return result.returncode


def _gather(run_dir: Path, code: int, capture: bool) -> RunResult:
    total = RunCounts()
    unreadable = unclosed = 0
    for path in sorted(run_dir.glob("counts-*.json")):
        try:
            counts, closed = read_process(path)
        except (OSError, ValueError):
            unreadable += 1
            continue
        total.add(counts)
        unclosed += not closed
    parts: list[CaptureFile] = []
    if capture:
        from farm.programs.capture import CaptureError, merge, read_capture

        for path in sorted(run_dir.glob("capture-*.json")):
            try:
                parts.append(read_capture(path))
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
    try:
        return signal.Signals(code - 128).name
    except ValueError:
        return ""
