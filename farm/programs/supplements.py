"""Work-group functions of an application's programs, stored beside the program.

On PoCL's CPU drivers a kernel's machine code (its *work-group function*) is made at the
kernel's first launch, specialised to the launch (local size, zero offset, grid class),
and kept in the program's folder (:mod:`farm.compilation.poclcache`). An application's
program declares no launch, so its stored binary holds none: without more, every node
compiles them again at every first launch. So the functions an application's launches
made are *harvested* (:mod:`farm.programs.harvest`) and stored as **records** beside the
program's artifact, and a node that loads the program merges the records it has proven
into the binary before PoCL unpacks it (:func:`farm.programs.prepared.merge`), so the
first launch of a known geometry finds its function and compiles nothing.

A record is an ordinary artifact (digest-verified, signed where signing is configured,
bound to its namespace). Its key is slot ``n`` of the program's records
(:func:`farm.core.keys.program_functions_key`), family ``program-wg``; slots are taken in
order, first writer wins, and a reader reads them in order until one is missing,
:data:`READ_AHEAD` at a time, the first ones while the program's artifact is still on its
way (:class:`SlotReader`). Its bytes (format 2)::

    b"KFWGSUP2" | u32 big endian N | N bytes of JSON (:class:`Header`) | the functions

The header names what the record is for, inside the digested (and signed) body: the
program's key, the build hash of the binary the functions were made from (``base``),
the device fingerprint, and for each function its kernel, local size, zero-offset and
grid class (PoCL's folder name is derived from these, never taken from input), its size
and SHA-256, and optionally the launch that made it (a ``ReadyLaunch``: then the proof
runs it). A record of another binary of the same program is stale: skipped in silence,
its slot stays taken.

What :func:`decode` accepts, and nothing else (anything else refuses the whole record,
never an exception of another kind): the program, binary and device are the ones being
loaded; each function belongs to a kernel of that program, once, with the size and
digest its header says, and is an ELF shared object of this host exporting that
kernel's work-group symbol; a recorded launch is of that kernel, with that local size
and grid class. A record that passes is then *proven* like every stored binary
(:mod:`farm.programs.proving`): merged into its program's binary and loaded in an
isolated child with a private PoCL cache, each function ``dlopen``\\ ed there, its
recorded launch run. Only then does a function reach the application's PoCL cache.

The binary an application loads is named by its own content
(:mod:`farm.programs.prepared`).
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import Field, StrictBool, StringConstraints, ValidationError

from farm.compilation.elfstub import MAX_FUNCTION_BYTES, exports
from farm.compilation.poclcache import FARM_NAMED, KERNEL, SPEC
from farm.compilation.ready import GRID_LIMIT, grid_width
from farm.core.errors import FarmError
from farm.core.hashing import sha256_hex
from farm.core.keys import (
    PROGRAM_FUNCTION_SLOTS,
    PROGRAM_FUNCTIONS_FAMILY,
    Namespace,
    program_functions_key,
)
from farm.core.model import SHA256_HEX, Artifact, Frozen, Key, ReadyLaunch
from farm.programs.headers import (
    DEVICE_PATTERN,
    MAX_FUNCTIONS,
    MAX_LOCAL,
    MAX_RECORD_HEADER,
    PROGRAM_PATTERN,
    StaleRecord,
    SupplementError,
    spec_name,
)
from farm.programs.headers import LENGTH as _LEN
from farm.programs.headers import RECORD_MAGIC as MAGIC
from farm.programs.prepared import Pair

#: typing.TYPE_CHECKING without importing typing for it: the tiers are read through, not
#: made here (a served process's quick path reads with tiers of its own, and imports no
#: store module for them: farm.programs.quick_pocl)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from farm.store.tiers import Tier

#: slots read at once (most programs have one record: the first two answer in one trip)
READ_AHEAD = 2
#: what a store may raise that only means "no records this time"
_UNAVAILABLE = (FarmError, OSError, sqlite3.Error)

#: strict: ``"16"`` or ``16.0`` is not a local size (records and captures are input)
Local = tuple[Annotated[int, Field(ge=1, le=MAX_LOCAL, strict=True)],
              Annotated[int, Field(ge=1, le=MAX_LOCAL, strict=True)],
              Annotated[int, Field(ge=1, le=MAX_LOCAL, strict=True)]]


def parse_spec(spec: str) -> tuple[tuple[int, int, int], bool, bool] | None:
    """(local size, zero offset, small grid) of a specialisation PoCL makes; ``None``
    for any other name (the generic ``0-0-0`` included)."""
    if not SPEC.match(spec):
        return None
    parts = spec.split("-")
    local = (int(parts[0]), int(parts[1]), int(parts[2]))
    if max(local) > MAX_LOCAL:
        return None
    return local, "goffs0" in parts[3:], "smallgrid" in parts[3:]


class Launched(Frozen):
    """What PoCL specialises a kernel's work-group function by: the kernel, the local
    size, a zero global offset and the grid class. A record files each function under
    these (the folder name is derived from them, never read); a capture records them
    for the functions a program's launches needed (:mod:`farm.programs.capture`)."""

    kernel: Annotated[str, StringConstraints(pattern=KERNEL.pattern)]
    local_size: Local
    zero_offset: StrictBool
    small_grid: StrictBool

    @property
    def spec(self) -> str:
        return spec_name(self.local_size, self.zero_offset, self.small_grid)

    @property
    def pair(self) -> Pair:
        return self.kernel, self.spec

    @classmethod
    def of(cls, pair: Pair) -> Launched | None:
        """The settings of ``pair``; ``None`` for a specialisation PoCL does not make."""
        parsed = parse_spec(pair[1])
        if parsed is None or not KERNEL.match(pair[0]):
            return None
        return cls(kernel=pair[0], local_size=parsed[0], zero_offset=parsed[1],
                   small_grid=parsed[2])


class Function(Launched):
    size: int = Field(ge=1, le=MAX_FUNCTION_BYTES)
    sha256: Annotated[str, StringConstraints(pattern=SHA256_HEX)]
    #: the launch that made it, where one was recorded (the proof runs it)
    launch: ReadyLaunch | None = None


class Header(Frozen):
    format: Literal[2] = 2
    program: str = Field(pattern=PROGRAM_PATTERN)
    base: str = Field(pattern=FARM_NAMED.pattern)
    device: str = Field(pattern=DEVICE_PATTERN)
    functions: tuple[Function, ...] = Field(min_length=1, max_length=MAX_FUNCTIONS)


@dataclass(frozen=True)
class Decoded:
    """A record's functions and the launches recorded for them."""

    functions: dict[Pair, bytes]
    launches: dict[Pair, ReadyLaunch] = field(default_factory=dict)


def encode(program: Key, base: str, device: str, functions: Mapping[Pair, bytes],
           launches: Mapping[Pair, ReadyLaunch] | None = None) -> bytes:
    """A record of ``functions`` (made on ``device`` from ``program``'s binary named
    ``base``); ``launches``: the launch that made a function, where one is known."""
    items = sorted(functions.items())
    out = []
    for (kernel, spec), data in items:
        parsed = parse_spec(spec)
        if parsed is None:
            raise SupplementError(f"{kernel}/{spec}: not a specialisation PoCL makes")
        out.append(Function(kernel=kernel, local_size=parsed[0], zero_offset=parsed[1],
                            small_grid=parsed[2], size=len(data), sha256=sha256_hex(data),
                            launch=(launches or {}).get((kernel, spec))))
    header = Header(program=str(program), base=base, device=device, functions=tuple(out))
    raw = header.model_dump_json(exclude_none=True).encode("utf-8")
    return MAGIC + _LEN.pack(len(raw)) + raw + b"".join(d for _, d in items)


def decode(data: bytes, program: Key, base: str, device: str, kernels: frozenset[str]
           ) -> Decoded:
    """The functions of a record, every rule of the module docstring checked."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LEN.size:
        raise SupplementError("not a work-group function record of this format")
    size = _LEN.unpack_from(data, len(MAGIC))[0]
    start = len(MAGIC) + _LEN.size
    if size > MAX_RECORD_HEADER or start + size > len(data):
        raise SupplementError("record header runs past the record")
    try:
        header = Header.model_validate(json.loads(data[start:start + size]))
    except (ValidationError, ValueError, RecursionError) as exc:
        raise SupplementError(f"record header does not validate: "
                              f"{' '.join(str(exc).split())}"[:200]) from None
    if header.program != str(program):
        raise SupplementError("record of another program")
    if header.base != base:
        raise StaleRecord(f"record of binary {header.base}, not {base}")
    if header.device != device:
        raise SupplementError(f"record made on device {header.device}, not {device}")
    out = Decoded(functions={})
    at = start + size
    for fn in header.functions:
        pair = (fn.kernel, fn.spec)
        body = data[at:at + fn.size]
        at += fn.size
        if len(body) != fn.size or sha256_hex(body) != fn.sha256:
            raise SupplementError(f"{fn.kernel}/{fn.spec}: bytes disagree with the header")
        if fn.kernel not in kernels:
            raise SupplementError(f"{fn.kernel}: no such kernel in the program")
        if pair in out.functions:
            raise SupplementError(f"{fn.kernel}/{fn.spec}: twice in the record")
        if not exports(body, fn.kernel):
            raise SupplementError(f"{fn.kernel}/{fn.spec}: not a work-group function of "
                                  "this host")
        if fn.launch is not None:
            why = _launch_disagrees(fn, fn.launch)
            if why:
                raise SupplementError(f"{fn.kernel}/{fn.spec}: {why}")
            out.launches[pair] = fn.launch
        out.functions[pair] = body
    if at != len(data):
        raise SupplementError("bytes after the last function")
    return out


def _launch_disagrees(fn: Function, launch: ReadyLaunch) -> str:
    """Why ``launch`` would not use the function ``fn`` ("" when it would)."""
    if launch.kernel_name != fn.kernel:
        return f"its recorded launch is of kernel {launch.kernel_name}"
    if launch.local_size is None:
        return "its recorded launch leaves the local size to the driver"
    local = (*launch.local_size, 1, 1)[:3]
    if local != fn.local_size or not fn.zero_offset:
        return "its recorded launch has another local size or offset"
    if (grid_width(launch.global_size, launch.local_size) < GRID_LIMIT) != fn.small_grid:
        return "its recorded launch is of another grid class"
    return ""


def record(program: Key, base: str, device: str, slot: int, functions: Mapping[Pair, bytes],
           source_hash: str, launches: Mapping[Pair, ReadyLaunch] | None = None) -> Artifact:
    """The artifact of one record, made by this process (``source_hash``: the program
    artifact's)."""
    host = socket.gethostname()
    return Artifact.create(program_functions_key(program, slot),
                           PROGRAM_FUNCTIONS_FAMILY,
                           encode(program, base, device, functions, launches),
                           source_hash, host=host, worker=f"{host}:{os.getpid()}")


def read_slot(art: Artifact, program: Key, base: str, device: str, slot: int,
              kernels: frozenset[str]) -> Decoded:
    """The functions of a stored record; :class:`SupplementError` for one refused."""
    if (art.meta.family != PROGRAM_FUNCTIONS_FAMILY
            or art.meta.key != program_functions_key(program, slot)):
        raise SupplementError("an artifact of another kind in a record's slot")
    return decode(art.binary, program, base, device, kernels)


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


@dataclass(frozen=True)
class Candidate:
    """A record that :func:`decode` accepted, not yet proven."""

    slot: int
    tier: int
    art: Artifact
    decoded: Decoded

    @property
    def functions(self) -> dict[Pair, bytes]:
        return self.decoded.functions


@dataclass(frozen=True)
class Refused:
    """A record refused before or at its proof, and why (it is quarantined)."""

    slot: int
    tier: int
    art: Artifact
    why: str


@dataclass
class Found:
    """A program's records as read: those to prove, those refused, the first free slot."""

    candidates: list[Candidate] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    next_slot: int = 0
    #: why records could not be read (one line)
    unread: str = ""


def read_records(reader: SlotReader, program: Key, base: str, device: str,
                 kernels: frozenset[str]) -> Found:
    """Every record slot of ``program`` in order until one is missing, decoded."""
    out = Found()
    for slot in range(PROGRAM_FUNCTION_SLOTS):
        try:
            art, tier = reader.get(slot)
        except _UNAVAILABLE as exc:
            out.unread = f"records not read ({' '.join(str(exc).split())[:200]})"
            break
        if art is None:
            break
        out.next_slot = slot + 1
        try:
            decoded = read_slot(art, program, base, device, slot, kernels)
        except StaleRecord:
            continue
        except SupplementError as exc:
            out.refused.append(Refused(slot, tier, art, str(exc)))
            continue
        out.candidates.append(Candidate(slot, tier, art, decoded))
    return out


def fill_front(tiers: list[Tier], ns: Namespace, fills: list[tuple[int, Artifact]]) -> None:
    """Copy records a later tier served into the tiers in front of it."""
    for served_by, art in fills:
        for front in tiers[:served_by]:
            try:
                front.store.put(ns, art)
            except _UNAVAILABLE:
                return  # the front tier is a cache: the next run reads it from the back
