"""Whether this thread is running the farm's own compile.

Every farm compile runs inside :func:`farm_compiling`, so a hook on
``pyopencl.Program.build`` in the same process (``farm.programs.hook``) lets it through
untouched instead of serving it. Kept apart from :mod:`farm.compilation.finalize` so that
a process the farm only serves (it loads binaries, never compiles) does not import the
compile path to ask the question.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_BUILDING = threading.local()


@contextlib.contextmanager
def farm_compiling() -> Iterator[None]:
    """Mark this thread as running the farm's own build."""
    outer = getattr(_BUILDING, "active", False)
    _BUILDING.active = True
    try:
        yield
    finally:
        _BUILDING.active = outer


def in_farm_compile() -> bool:
    """Whether this thread is inside :func:`farm_compiling`."""
    return bool(getattr(_BUILDING, "active", False))
