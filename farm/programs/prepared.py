"""What a PoCL node loads of a stored program: its binary with the work-group functions of
its proven records merged in, under a name of its own content; and the structure a
program binary the farm stores must have. Standard library only: the program server
(:mod:`farm.programs.proving`) and a served application's quick path
(:mod:`farm.programs.quick_pocl`) both use it.

The binary an application loads is named by its own content (:func:`merge`:
:func:`farm.compilation.poclbin.renamed`), so the node's PoCL folder for it holds only
what those very bytes held and what PoCL made from them: once a record is gone from the
store, no later process loads a binary with its function, nor harvests it from a folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from farm.compilation.poclbin import (
    GENERIC,
    PoclBinaryError,
    add_files,
    build_hash,
    function_folder,
    function_path,
    kernel_file_data,
    kernel_files,
    named_by_content,
    renamed,
)
from farm.compilation.poclcache import SPEC

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any, Protocol

    class Merged(Protocol):
        """A record to merge: the tier that held it, the artifact (what is copied into the
        tiers in front of it), its functions."""

        @property
        def tier(self) -> int: ...

        @property
        def art(self) -> object: ...

        @property
        def functions(self) -> Mapping[tuple[str, str], bytes]: ...

#: the tag of the name a merged binary is loaded under (:func:`merge`)
LOADED_TAG = b"kernel-farm loaded program 2\n"

#: (kernel, specialisation folder name, e.g. ``16-1-1-goffs0-smallgrid``)
Pair = tuple[str, str]


def structure(binary: bytes, compiles_at_launch: bool) -> str:
    """Why ``binary`` is not a program binary the farm stores for a device ("" when it
    may be one; the driver decides the rest, in the proof's child): on PoCL's CPU drivers
    (``compiles_at_launch``) it walks exactly, is named by its own content and carries no
    specialised work-group function (a program's never does: those travel in records)."""
    if not compiles_at_launch:
        return "" if binary else "the body holds no binary"
    try:
        files = kernel_files(binary)
        if not named_by_content(binary):
            return "the binary is not named by its content (not one the farm made)"
    except PoclBinaryError as exc:
        return f"the binary does not walk: {exc}"
    for kernel, paths in files.items():
        for path in paths:
            if function_folder(path) != GENERIC:
                return (f"the binary carries a work-group function ({kernel}/"
                        f"{function_folder(path)}); a program's never does")
    return ""


@dataclass
class Prepared:
    """A program's binary as a PoCL node loads it: the stored one with its proven
    records' functions merged in, under a name of its own content, and what a harvest
    needs to know about it."""

    binary: bytes
    #: the build hash of the stored binary (what records name)
    base: str
    #: the build hash ``binary`` is loaded under (the folder PoCL unpacks it into)
    folder: str
    kernels: tuple[str, ...]
    #: (kernel, specialisation) pairs the loaded binary carries
    known: set[Pair] = field(default_factory=set)
    #: the first slot no reader found (where a harvest writes next)
    next_slot: int = 0
    #: functions merged from records
    merged: int = 0
    #: records to copy into the tiers in front of the one that served them (tier, art)
    fills: list[tuple[int, Any]] = field(default_factory=list)  # (tier, its artifact)


def merge(binary: bytes, base: str, records: Sequence[Merged], next_slot: int) -> Prepared:
    """``binary`` (a program's stored one, named ``base``) with the functions of
    ``records`` (proven) added, under a name of the merged content
    (:data:`LOADED_TAG`); :class:`~farm.compilation.poclbin.PoclBinaryError` when it
    cannot be walked (the caller proved it walks)."""
    files = kernel_file_data(binary)
    known = {(k, function_folder(p)) for k, held in files.items() for p in held
             if SPEC.match(function_folder(p))}
    adding: dict[str, dict[str, bytes]] = {}
    fills = []
    for rec in records:
        if rec.tier:
            fills.append((rec.tier, rec.art))
        for (kernel, spec), data in rec.functions.items():
            if (kernel, spec) not in known:
                adding.setdefault(kernel, {})[function_path(kernel, spec)] = data
                known.add((kernel, spec))
    merged = add_files(binary, adding) if adding else binary
    loaded = renamed(merged, LOADED_TAG)
    return Prepared(binary=loaded, base=base, folder=build_hash(loaded), kernels=tuple(files),
                    known=known, next_slot=next_slot,
                    merged=sum(len(v) for v in adding.values()), fills=fills)
