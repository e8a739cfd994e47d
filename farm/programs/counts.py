"""What one application run got from the farm: five counts, one line, one JSON object.

* ``programs``: source builds the hook saw (``Program(ctx, src).build(...)``);
* ``loaded``: served from a binary (memory, the local tier, MinIO), no compile;
* ``compiled``: compiled by the farm (here or on the cluster), stored, then served;
* ``fallbacks``: built the plain way because the farm could not help (a service down, a
  refused binary, options it cannot key), each announced by one warning line;
* ``failed``: builds that raised, with pyopencl's own error (a source that does not
  compile fails exactly as it would without the farm).

``programs == loaded + compiled + fallbacks + failed``. The line and the JSON hold
exactly these keys (``farm run --json FILE``), so scripts can rely on them.

Under ``farm run`` each served process keeps its own counts file in the run's folder
(:func:`write_process`), written when the hook is installed, again after every build and
once more, ``closed``, when the process ends as the farm expects (at exit, at the end
of a multiprocessing child, on the SIGTERM a pool sends its workers). So a process
killed outright still counts every build it finished, and ``farm run`` can say how many
processes ended without closing (:func:`read_process`).
"""

from __future__ import annotations

import json
import threading

from farm.core.outcomes import Fate

#: typing.TYPE_CHECKING without importing typing, nor dataclasses: ``farm run``'s own
#: process imports this module, and each import is paid on every run
TYPE_CHECKING = False
if TYPE_CHECKING:
    from os import PathLike
    from typing import Literal

    Count = Literal["programs", Fate.LOADED, Fate.COMPILED, "fallbacks", Fate.FAILED]

KEYS: tuple[Count, ...] = ("programs", Fate.LOADED, Fate.COMPILED, "fallbacks", Fate.FAILED)


class RunCounts:
    """The counts of one process (thread-safe)."""

    def __init__(self) -> None:
        self.values: dict[str, int] = dict.fromkeys(KEYS, 0)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RunCounts({self.snapshot()})"

    def bump(self, name: Count) -> None:
        with self._lock:
            self.values[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)

    def add(self, other: dict[str, int]) -> None:
        """Add another process's counts (``farm run`` sums its children's)."""
        with self._lock:
            for k in KEYS:
                self.values[k] += int(other.get(k, 0))


def summary_line(counts: dict[str, int]) -> str:
    """``kernel-farm: programs 29, loaded 29, compiled 0, fallbacks 0, failed 0``."""
    return "kernel-farm: " + ", ".join(f"{k} {counts.get(k, 0)}" for k in KEYS)


def write_json(path: str | PathLike[str], counts: dict[str, int]) -> None:
    """``counts`` as a JSON object with exactly :data:`KEYS`, written atomically."""
    _write(path, {k: int(counts.get(k, 0)) for k in KEYS})


def write_process(path: str | PathLike[str], counts: dict[str, int], closed: bool) -> None:
    """One process's counts, and whether it ended as expected, written atomically (a
    temporary file per process and thread: threads of one process may write at once)."""
    record: dict[str, object] = {k: int(counts.get(k, 0)) for k in KEYS}
    record["closed"] = bool(closed)
    _write(path, record)


def _write(path: str | PathLike[str], record: dict[str, object]) -> None:
    import os

    target = os.fspath(path)
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
    os.replace(tmp, target)


def read_process(path: str | PathLike[str]) -> tuple[dict[str, int], bool]:
    """What :func:`write_process` wrote: the counts, and whether the process closed."""
    with open(path, encoding="utf-8") as fh:
        raw = json.load(fh)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    return {k: int(raw.get(k, 0)) for k in KEYS}, raw.get("closed") is True


