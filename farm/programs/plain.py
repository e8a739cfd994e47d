"""A build the farm does not serve: pyopencl's own, counted, and the one line that says why.

The program server (:mod:`farm.programs.serve`) and the hook (:mod:`farm.programs.hook`,
once the store has stopped answering) both build the plain way; what that counts, and
how the farm says it is unavailable, is here, once, with nothing imported that a served
process's quick path (:mod:`farm.programs.quick`) does not already have.

What a source that does not compile prints (PoCL's compiler writes its diagnostics, "1
error generated.", straight to the process's stderr) is printed once: the farm's own
compile of it runs with stderr held (:func:`driver_output_held`), and what it printed is
dropped when pyopencl's build, which prints it again, follows; kept and printed after a
compile that succeeded (a warning says what a plain build would have said).
"""

from __future__ import annotations

import contextlib
import os
import sys

from farm.compilation.compiling import farm_compiling
from farm.core.errors import printable
from farm.core.outcomes import Fate

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import TypeVar

    from farm.programs.counts import RunCounts

    T = TypeVar("T")

#: characters of a failure's text a warning line carries (the text comes from drivers and
#: services; past this it ends with "...")
WHY_LIMIT = 400


def build_plain(plain: Callable[[], T], counts: RunCounts) -> T:
    """``plain()`` (pyopencl's build; the hook never serves what runs inside it), counted
    as a fallback, or as failed when it raises."""
    try:
        with farm_compiling():
            result = plain()
    except BaseException:
        counts.bump(Fate.FAILED)
        raise
    counts.bump("fallbacks")
    return result


def why(exc: BaseException) -> str:
    """``exc`` as the reason a warning line gives: one line, printable, bounded."""
    return printable(" ".join(str(exc).split()), WHY_LIMIT)


def unavailable(reason: str) -> str:
    """The line (without ``kernel-farm: warning:``) that says the farm stopped helping."""
    return (f"the farm is unavailable ({reason}); this run's programs are built the plain "
            "way from now on")


def warn(text: str) -> None:
    """One warning line on stderr, as the farm says them in an application."""
    print(f"kernel-farm: warning: {text}", file=sys.stderr, flush=True)


class Held:
    """What :func:`driver_output_held` holds; ``keep`` False drops it."""

    keep = True


@contextlib.contextmanager
def driver_output_held() -> Iterator[Held]:
    """Stderr (the file descriptor: the driver writes there directly) held in a file for
    the block, then written out unless the block set ``keep`` False. Anything another
    thread writes meanwhile is held too, and written out with it (late, never lost,
    except with a held output dropped: a compile that failed, which is brief)."""
    import tempfile

    held = Held()
    sys.stderr.flush()
    try:
        saved = os.dup(2)
        buffer = tempfile.TemporaryFile()
    except OSError:  # no stderr to hold (closed): nothing to print twice either
        yield held
        return
    try:
        os.dup2(buffer.fileno(), 2)
        try:
            yield held
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
        if held.keep:
            buffer.seek(0)
            data = buffer.read()
            if data:
                os.write(2, data)
    finally:
        os.close(saved)
        buffer.close()
