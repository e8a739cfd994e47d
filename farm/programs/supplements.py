"""Work-group functions of an application's programs, stored beside the program.

On PoCL's CPU drivers a kernel's machine code (its *work-group function*) is made at the
kernel's first launch, specialised to the launch (local size, zero offset, grid class),
and kept in the program's folder (:mod:`farm.compilation.poclcache`). An application's
program declares no launch, so its stored binary holds none (the farm never launches
opaque kernels on made-up buffers): without more, every node compiles them again at
every first launch. So the functions an application's launches made are *harvested*
(:mod:`farm.programs.harvest`) and stored as **records** beside the program's artifact,
and a node that loads the program merges every record it finds into the binary before
PoCL unpacks it (:func:`prepare`), so the first launch of a known geometry finds its
function and compiles nothing.

A record is an ordinary artifact, so it is digest-verified, signed where signing is
configured and bound to its namespace like every other one. Its key is slot ``n`` of
the program's records (:func:`farm.core.keys.program_functions_key`: the program's key
and the slot), family ``program-wg``; slots are taken in order, first writer wins, and
a reader reads them in order until one is missing, :data:`READ_AHEAD` at a time, the
first ones while the program's artifact is still on its way (:class:`SlotReader`). Its
bytes::

    b"KFWGSUP1" | u32 big endian N | N bytes of JSON (:class:`Header`) | the functions

the header naming the program, the build hash of the binary the functions were made
from, and for each function its kernel, specialisation, size and SHA-256, in the order
their bytes follow. A record of another binary of the same program (the artifact was
removed and compiled again since) is stale: skipped in silence, its slot stays taken.

What a reader accepts, and nothing else (anything else makes the whole record a miss,
never an error and never a crash): the record's program and build hash are the ones
being loaded; each function belongs to a kernel of that program, under a specialisation
PoCL makes (``16-1-1-goffs0-smallgrid``; never the generic ``0-0-0``), with the size
and digest its header says, and is an ELF shared object of this host exporting that
kernel's work-group symbol (:func:`farm.compilation.elfstub.exports`: PoCL aborts the
application on one that does not). It is written into the binary only as
``/<kernel>/<spec>/<kernel>.so`` (:func:`farm.compilation.poclbin.add_files`). Only
binaries the farm named by their content (``kf...``) take records: the random name of an
older artifact is no program's identity.
"""

from __future__ import annotations

import json
import sqlite3
import struct
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, ValidationError

from farm.compilation.elfstub import MAX_FUNCTION_BYTES, exports
from farm.compilation.poclbin import (
    PoclBinaryError,
    add_files,
    build_hash,
    function_folder,
    function_path,
    kernel_file_data,
)
from farm.compilation.poclcache import FARM_NAMED, KERNEL, SPEC
from farm.core.errors import FarmError
from farm.core.hashing import sha256_hex
from farm.core.keys import (
    PROGRAM_FUNCTION_SLOTS,
    PROGRAM_FUNCTIONS_FAMILY,
    Namespace,
    program_functions_key,
)
from farm.core.model import SHA256_HEX, Artifact, Frozen, Key

#: typing.TYPE_CHECKING without importing typing for it: the tiers are read through, not
#: made here (a served process's quick path reads with tiers of its own, and imports no
#: store module for them: farm.programs.quick_pocl)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from farm.store.tiers import Tier

MAGIC = b"KFWGSUP1"
_LEN = struct.Struct(">I")
#: functions one record holds at most; a harvest with more writes several records
MAX_FUNCTIONS = 256
#: bytes of functions one record holds at most
MAX_RECORD_BYTES = 64 * 1024 * 1024
_MAX_HEADER = 256 * 1024
#: slots read at once (most programs have one record: the first two answer in one trip)
READ_AHEAD = 2
#: what a store may raise that only means "no records this time"
_UNAVAILABLE = (FarmError, OSError, sqlite3.Error)

#: (kernel, specialisation)
Pair = tuple[str, str]


class Function(Frozen):
    kernel: Annotated[str, StringConstraints(pattern=KERNEL.pattern)]
    spec: Annotated[str, StringConstraints(pattern=SPEC.pattern)]
    size: int = Field(ge=1, le=MAX_FUNCTION_BYTES)
    sha256: Annotated[str, StringConstraints(pattern=SHA256_HEX)]


class Header(Frozen):
    format: Literal[1] = 1
    program: str = Field(pattern=r"^[0-9a-f]{8,64}\.[0-9a-f]{8,64}$")
    base: str = Field(pattern=FARM_NAMED.pattern)
    functions: tuple[Function, ...] = Field(min_length=1, max_length=MAX_FUNCTIONS)


class SupplementError(ValueError):
    """A record that is not one this reader accepts (see the module docstring)."""


class StaleRecord(SupplementError):
    """A record of another binary of the same program."""


def encode(program: Key, base: str, functions: Mapping[Pair, bytes]) -> bytes:
    """A record of ``functions`` for ``program``'s binary named ``base``."""
    items = sorted(functions.items())
    header = Header(program=str(program), base=base, functions=tuple(
        Function(kernel=k, spec=s, size=len(d), sha256=sha256_hex(d)) for (k, s), d in items))
    raw = header.model_dump_json().encode("utf-8")
    return MAGIC + _LEN.pack(len(raw)) + raw + b"".join(d for _, d in items)


def decode(data: bytes, program: Key, base: str, kernels: frozenset[str]
           ) -> dict[Pair, bytes]:
    """The functions of a record, every rule of the module docstring checked."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LEN.size:
        raise SupplementError("not a work-group function record")
    size = _LEN.unpack_from(data, len(MAGIC))[0]
    start = len(MAGIC) + _LEN.size
    if size > _MAX_HEADER or start + size > len(data):
        raise SupplementError("record header runs past the record")
    try:
        header = Header.model_validate(json.loads(data[start:start + size]))
    except (ValidationError, ValueError) as exc:
        raise SupplementError(f"record header does not validate: {exc}"[:200]) from None
    if header.program != str(program):
        raise SupplementError("record of another program")
    if header.base != base:
        raise StaleRecord(f"record of binary {header.base}, not {base}")
    out: dict[Pair, bytes] = {}
    at = start + size
    for fn in header.functions:
        body = data[at:at + fn.size]
        at += fn.size
        if len(body) != fn.size or sha256_hex(body) != fn.sha256:
            raise SupplementError(f"{fn.kernel}/{fn.spec}: bytes disagree with the header")
        if fn.kernel not in kernels:
            raise SupplementError(f"{fn.kernel}: no such kernel in the program")
        if not exports(body, fn.kernel):
            raise SupplementError(f"{fn.kernel}/{fn.spec}: not a work-group function of "
                                  "this host")
        out[(fn.kernel, fn.spec)] = body
    if at != len(data):
        raise SupplementError("bytes after the last function")
    return out


def record(program: Key, base: str, slot: int, functions: Mapping[Pair, bytes],
           source_hash: str, host: str = "", worker: str = "") -> Artifact:
    """The artifact of one record (``source_hash``: the program artifact's)."""
    return Artifact.create(program_functions_key(program, slot),
                           PROGRAM_FUNCTIONS_FAMILY, encode(program, base, functions),
                           source_hash, host=host, worker=worker)


def read_slot(art: Artifact, program: Key, base: str, slot: int,
              kernels: frozenset[str]) -> dict[Pair, bytes]:
    """The functions of a stored record; :class:`SupplementError` for one refused."""
    if (art.meta.family != PROGRAM_FUNCTIONS_FAMILY
            or art.meta.key != program_functions_key(program, slot)):
        raise SupplementError("an artifact of another kind in a record's slot")
    return decode(art.binary, program, base, kernels)


@dataclass
class Prepared:
    """A program's binary as a PoCL node loads it: the stored one with every record's
    functions merged in, and what a harvest needs to know about it."""

    binary: bytes
    base: str
    kernels: tuple[str, ...]
    #: (kernel, specialisation) pairs the binary carries
    known: set[Pair] = field(default_factory=set)
    #: the first slot no reader found
    next_slot: int = 0
    #: functions merged from records
    merged: int = 0
    #: records to copy into the tiers in front of the one that served them
    fills: list[tuple[int, Artifact]] = field(default_factory=list)
    #: why records were ignored (one line each)
    ignored: list[str] = field(default_factory=list)


class SlotReader:
    """A program's record slots, read in order from the first tier that holds each,
    :data:`READ_AHEAD` at a time on ``pool`` (one at a time without a pool)."""

    def __init__(self, tiers: list[Tier], ns: Namespace, program: Key,
                 pool: Executor | None = None) -> None:
        self._tiers, self._ns, self._program, self._pool = tiers, ns, program, pool
        self._ahead: dict[int, Future[tuple[Artifact | None, int]]] = {}
        self._read_ahead(0)

    def _read_ahead(self, first: int) -> None:
        if self._pool is None:
            return
        for slot in range(first, min(first + READ_AHEAD, PROGRAM_FUNCTION_SLOTS)):
            if slot not in self._ahead:
                self._ahead[slot] = self._pool.submit(self._read, slot)

    def _read(self, slot: int) -> tuple[Artifact | None, int]:
        key = program_functions_key(self._program, slot)
        for i, tier in enumerate(self._tiers):
            art = tier.store.get(self._ns, key)
            if art is not None:
                return art, i
        return None, 0

    def get(self, slot: int) -> tuple[Artifact | None, int]:
        """Slot ``slot``'s record and the index of the tier that held it; what a store
        raises comes out here."""
        ahead = self._ahead.pop(slot, None)
        if ahead is None:
            return self._read(slot)
        if slot + 1 not in self._ahead:
            self._read_ahead(slot + 1)
        return ahead.result()


def prepare(reader: SlotReader, program: Key, binary: bytes) -> Prepared | None:
    """``binary`` (``program``'s stored one) with its records (from ``reader``) merged;
    ``None`` where records do not apply (a binary this farm did not name, or cannot
    walk)."""
    try:
        base = build_hash(binary)
        files = kernel_file_data(binary)
    except PoclBinaryError:
        return None
    if not FARM_NAMED.match(base):
        return None
    out = Prepared(binary=binary, base=base, kernels=tuple(files))
    out.known = {(k, function_folder(p)) for k, held in files.items() for p in held
                 if SPEC.match(function_folder(p))}
    names = frozenset(out.kernels)
    adding: dict[str, dict[str, bytes]] = {}
    for slot in range(PROGRAM_FUNCTION_SLOTS):
        try:
            art, tier = reader.get(slot)
        except _UNAVAILABLE as exc:
            out.ignored.append(f"records not read ({' '.join(str(exc).split())[:200]})")
            break
        if art is None:
            break
        out.next_slot = slot + 1
        try:
            functions = read_slot(art, program, base, slot, names)
        except StaleRecord:
            continue
        except SupplementError as exc:
            out.ignored.append(f"record {slot} ignored: {exc}")
            continue
        if tier:
            out.fills.append((tier, art))
        for (kernel, spec), data in functions.items():
            if (kernel, spec) not in out.known:
                adding.setdefault(kernel, {})[function_path(kernel, spec)] = data
                out.known.add((kernel, spec))
    if adding:
        try:
            out.binary = add_files(binary, adding)
            out.merged = sum(len(v) for v in adding.values())
        except PoclBinaryError as exc:  # by construction it walks; never serve a doubt
            out.ignored.append(f"functions not merged: {exc}")
            out.known -= {(k, function_folder(p)) for k, v in adding.items() for p in v}
    return out


def fill_front(tiers: list[Tier], ns: Namespace, fills: list[tuple[int, Artifact]]) -> None:
    """Copy records a later tier served into the tiers in front of it."""
    for served_by, art in fills:
        for front in tiers[:served_by]:
            try:
                front.store.put(ns, art)
            except _UNAVAILABLE:
                return  # the front tier is a cache: the next run reads it from the back
