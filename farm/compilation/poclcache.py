"""Where PoCL keeps a program's files on disk, as seen from the process that uses it.

PoCL (3.x to 5.x, ``lib/CL/pocl_cache.c``) keeps every program of a process in a folder
under its cache's top folder: ``POCL_CACHE_DIR``, else ``$XDG_CACHE_HOME`` (or
``~/.cache``, or ``/tmp``) ``/pocl/kcache`` with its kernel cache on, ``/pocl/uncached``
with it off (``POCL_KERNEL_CACHE=0``). The folder's name is the program's *build hash*:

* a program built from source with the kernel cache on: a SHA-1 of the preprocessed
  source, the options and the device, as 40 letters with a ``/`` after the second
  (``AB/CDEF...``: two levels);
* built from source with the cache off: ``_UNCACHED_`` and six random characters (and
  PoCL deletes the folder when the program is released);
* made from a binary: the build hash the binary's header names (the farm's program
  binaries are named by their content, ``kf`` and 38 hex digits:
  :func:`farm.compilation.poclbin.rewrite`).

In that folder, ``program.bc`` and each kernel's work-group functions,
``<kernel>/<local size>[-goffs0][-smallgrid]/<kernel>.so`` (``0-0-0``: the generic one),
written under a temporary name and renamed, so a file that is there is whole.

PoCL tells nobody which folder a source build got. :func:`built_folder` finds it by what
the build just wrote, and answers only when that is certain; :func:`loaded_folder` finds
the folder of a program made from a binary by its name; :func:`work_group_functions`
lists what a folder holds for some kernels.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: a specialised work-group function's folder (the generic ``0-0-0`` does not match)
SPEC = re.compile(r"^[1-9]\d{0,8}-[1-9]\d{0,8}-[1-9]\d{0,8}(-goffs0)?(-smallgrid)?$")
#: a kernel name the farm handles on disk (an OpenCL C identifier PoCL does not clip)
KERNEL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,199}$")
#: the name of a program folder the farm named (``poclbin.rewrite``)
FARM_NAMED = re.compile(r"^kf[0-9a-f]{38}$")
_HASHED = re.compile(r"^[A-P]{2}$")
#: a coarse file clock may stamp a file up to a tick before ``time.time()`` said
CLOCK_SLACK_S = 0.2
#: most candidate folders a search reads before it gives up (a busy shared cache)
MAX_CANDIDATES = 64


def top_folders() -> list[Path]:
    """The cache top folders PoCL may be using in this process, existing ones only."""
    set_dir = os.environ.get("POCL_CACHE_DIR")
    if set_dir:
        tops = [Path(set_dir)]
    else:
        base = os.environ.get("XDG_CACHE_HOME") or (
            os.path.join(os.environ["HOME"], ".cache") if os.environ.get("HOME") else "/tmp")
        tops = [Path(base, "pocl", "kcache"), Path(base, "pocl", "uncached")]
    return [t for t in tops if t.is_dir()]


def built_folder(since: float, kernel_names: tuple[str, ...]) -> Path | str:
    """The folder of the program this process just built from source (after ``since``,
    a ``time.time()`` taken before the build), or why it cannot be told for certain.

    Candidates are the program folders created or touched since then (by this build,
    and by any other process using the same cache at the same moment); the one whose
    ``program.bc`` names every kernel of this program is ours. Two such (the same
    kernels built at the same time elsewhere) answer a reason, never a guess.
    """
    floor = since - CLOCK_SLACK_S
    found: list[Path] = []
    for top in top_folders():
        for folder in _recent_programs(top, floor):
            found.append(folder)
            if len(found) > MAX_CANDIDATES:
                return f"more than {MAX_CANDIDATES} programs built at once in {top}"
    needles = [n.encode("utf-8") for n in kernel_names]
    ours = [f for f in found if _names_all(f / "program.bc", needles, floor)]
    if len(ours) == 1:
        return ours[0]
    return (f"{len(ours)} program folders built just now hold these kernels"
            if ours else "no program folder built just now holds these kernels")


def _recent_programs(top: Path, floor: float) -> list[Path]:
    """Program folders under ``top`` changed at or after ``floor``."""
    out: list[Path] = []
    try:
        entries = list(os.scandir(top))
    except OSError:
        return out
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_mtime < floor:
                continue
            if entry.name.startswith("_UNCACHED_"):
                out.append(Path(entry.path))
            elif _HASHED.match(entry.name):  # the kernel cache's two levels
                out.extend(Path(e.path) for e in os.scandir(entry.path)
                           if e.is_dir(follow_symlinks=False) and e.stat().st_mtime >= floor)
        except OSError:
            continue  # removed meanwhile (another process released its program)
    return out


def _names_all(program_bc: Path, needles: list[bytes], floor: float) -> bool:
    """Whether ``program_bc`` was written since ``floor`` and holds every kernel name
    (LLVM bitcode keeps symbol names as plain bytes in its string table)."""
    try:
        if program_bc.stat().st_mtime < floor:
            return False
        data = program_bc.read_bytes()
    except OSError:
        return False
    return all(n in data for n in needles)


def loaded_folder(build_hash: str) -> Path | None:
    """The folder PoCL unpacked a binary named ``build_hash`` into (it holds the
    program's ``program.bc``), or ``None``. Only names the farm gives (``kf...``)."""
    if not FARM_NAMED.match(build_hash):
        return None
    for top in top_folders():
        folder = top / build_hash
        if (folder / "program.bc").is_file():
            return folder
    return None


def work_group_functions(folder: Path, kernel_names: tuple[str, ...]
                         ) -> dict[tuple[str, str], Path]:
    """(kernel, specialisation) -> file, for every specialised work-group function
    ``folder`` holds for ``kernel_names`` (names PoCL would clip are skipped)."""
    out: dict[tuple[str, str], Path] = {}
    for kernel in kernel_names:
        if not KERNEL.match(kernel):
            continue
        try:
            specs = [e.name for e in os.scandir(folder / kernel)
                     if e.is_dir(follow_symlinks=False) and SPEC.match(e.name)]
        except OSError:
            continue
        for spec in specs:
            path = folder / kernel / spec / f"{kernel}.so"
            if path.is_file():
                out[(kernel, spec)] = path
    return out
