"""Captures: every program an application built, as a file the fleet can build from.

The Fossilize model: record what an application builds where it runs, then prepare it
everywhere (``farm build CAPTURE --cluster``, ``--fingerprint`` for a device type the
capture never saw) before the jobs start, so that no node compiles.

Format ``kernel-farm-capture`` version 1, one JSON object::

    {"format": "kernel-farm-capture", "version": 1, "farm_version": "...",
     "programs": [{"spec": <ProgramSpec>, "fingerprints": ["pocl-...", ...],
                   "launches": {"pocl-...": [{"kernel": "k", "local_size": [16, 1, 1],
                                              "zero_offset": true, "small_grid": true},
                                             ...]}}, ...],
     "blobs": {"<sha256>": {"text": "..."} | {"base64": "..."}, ...}}

``launches`` (optional; captures made before it still read) says, per PoCL device
fingerprint, which work-group functions the program's kernels needed there: what PoCL
specialises a kernel's machine code by at a launch (kernel, local size, zero offset,
grid class; :class:`~farm.programs.supplements.Launched`). The capturing process learns
them the way the harvest does, from the folder PoCL keeps the program's functions in,
at its end (:meth:`farm.programs.harvest.Harvester.launched`): nothing is hooked at
launch time. ``farm build CAPTURE`` makes those functions on the build host and stores
them beside the program (:mod:`farm.programs.making`), so a node prepared from the
capture alone compiles nothing at its first launches.

A program's source and headers are named by digest in its spec and held once each in
``blobs`` (as text when UTF-8, else base64), so the file needs nothing else to be built
on another machine. A capture is **input**: it is validated as a whole before anything
is built (JSON, every field, every blob's digest, every digest a spec names present), and
a file that fails says so in one line naming the place (:class:`CaptureError`). Its
reader has limits, checked before the models see a byte: the file's size, JSON nested
at most :data:`MAX_DEPTH` deep, integers of at most :data:`MAX_DIGITS` digits, no
``NaN`` or ``Infinity``, ``version`` the integer 1 (``true`` is not), at most
:data:`MAX_PROGRAMS` programs, :data:`MAX_BLOBS` blobs and :data:`MAX_LAUNCHES` launches
(a program's launches name devices it was built for, at most
:data:`MAX_PROGRAM_LAUNCHES` per device); and a spec's build options go
through the rules of an application's (``farm.programs.options``: no include folder, no
option naming a file). The same program listed many times is one program
(:func:`farm.programs.prebuild.targets` builds each key once).
"""

from __future__ import annotations

import base64
import binascii
import json
import stat
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, ValidationError, model_validator

from farm.core.errors import InputError, first_error
from farm.core.hashing import sha256_hex
from farm.core.keys import Namespace
from farm.core.model import SHA256_HEX, Frozen
from farm.programs.spec import MAX_SOURCE_BYTES, Described, ProgramSpec
from farm.programs.supplements import MAX_FUNCTIONS, Launched, Pair
from farm.version import __version__

FORMAT: Literal["kernel-farm-capture"] = "kernel-farm-capture"
VERSION: Literal[1] = 1
#: a capture larger than this is refused before it is read
MAX_CAPTURE_BYTES = 1024 * 1024 * 1024
#: JSON nesting a capture may have (the format itself nests 6 deep)
MAX_DEPTH = 32
#: digits an integer of a capture may have (every field fits in 64 bits)
MAX_DIGITS = 20
#: programs, and blobs, one capture may list
MAX_PROGRAMS = 100_000
MAX_BLOBS = 1_000_000
#: applications (main scripts) one capture names at most
MAX_APPLICATIONS = 64
#: launches one capture may list in all, and one program on one device
MAX_LAUNCHES = 1_000_000
MAX_PROGRAM_LAUNCHES = MAX_FUNCTIONS

Fingerprint = Annotated[str, StringConstraints(min_length=1, max_length=100)]


class CaptureError(InputError):
    """A capture file that cannot be used: one line naming the file and the place."""


class Blob(Frozen):
    """One source or header: UTF-8 text, or base64 for any other bytes."""

    text: str | None = Field(default=None, max_length=MAX_SOURCE_BYTES)
    base64: str | None = Field(default=None, max_length=2 * MAX_SOURCE_BYTES)

    @model_validator(mode="after")
    def _one(self) -> Blob:
        if (self.text is None) == (self.base64 is None):
            raise ValueError("a blob holds exactly one of text and base64")
        return self

    def data(self) -> bytes:
        if self.text is not None:
            return self.text.encode("utf-8", "surrogatepass")
        try:
            return base64.b64decode(self.base64 or "", validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("base64 that does not decode") from None

    @classmethod
    def of(cls, data: bytes) -> Blob:
        try:
            return cls(text=data.decode("utf-8"))
        except UnicodeDecodeError:
            return cls(base64=base64.b64encode(data).decode("ascii"))


class CapturedProgram(Frozen):
    spec: ProgramSpec
    #: the devices it was built for
    fingerprints: tuple[Fingerprint, ...] = Field(default=(), max_length=1024)
    #: per device (PoCL's CPU drivers), the work-group functions its launches needed
    launches: dict[Fingerprint, Annotated[tuple[Launched, ...], Field(
        max_length=MAX_PROGRAM_LAUNCHES)]] | None = Field(default=None, max_length=1024)

    def launched(self, fingerprint: str) -> frozenset[Pair]:
        """The (kernel, specialisation) pairs recorded for ``fingerprint``."""
        return frozenset(x.pair for x in (self.launches or {}).get(fingerprint, ()))


class CaptureFile(Frozen):
    format: Literal["kernel-farm-capture"] = FORMAT
    version: Literal[1] = VERSION  # an integer: read_capture refuses true
    farm_version: str = Field(default=__version__, max_length=64)
    programs: tuple[CapturedProgram, ...] = Field(default=(), max_length=MAX_PROGRAMS)
    blobs: dict[Annotated[str, StringConstraints(pattern=SHA256_HEX)], Blob] = Field(
        default_factory=dict, max_length=MAX_BLOBS)
    #: the digests of the main scripts of the processes captured
    #: (:func:`farm.programs.plan.application_digest`): ``farm build CAPTURE`` stores
    #: their plan, so a node prepared from the capture proves its programs ahead
    applications: tuple[Annotated[str, StringConstraints(pattern=SHA256_HEX)], ...] = Field(
        default=(), max_length=MAX_APPLICATIONS)

    def fingerprints(self) -> list[str]:
        """Every fingerprint a program of the capture was built for, sorted."""
        return sorted({f for p in self.programs for f in p.fingerprints})

    def blob(self, digest: str) -> bytes:
        return self.blobs[digest].data()


#: (program key's id hash, device fingerprint) -> the (kernel, specialisation) pairs the
#: program's launches needed there
Launches = Mapping[tuple[str, str], set[Pair] | frozenset[Pair]]


class CaptureLog:
    """What one process built, gathered as it runs (thread-safe); the launches come from
    whoever :meth:`follow` names, asked once, when the file is made."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._programs: dict[str, tuple[ProgramSpec, set[str]]] = {}
        self._blobs: dict[str, bytes] = {}
        self._launched: Callable[[], Launches] | None = None

    def follow(self, launched: Callable[[], Launches]) -> None:
        """Ask ``launched`` for the programs' launches when the file is made (the
        program server's harvest: what PoCL's folders hold by then)."""
        self._launched = launched

    def add(self, described: Described, fingerprints: list[str]) -> None:
        key = described.spec.key.id_hash
        with self._lock:
            _, seen = self._programs.setdefault(key, (described.spec, set()))
            seen.update(fingerprints)
            self._blobs.update(described.blobs())

    def __len__(self) -> int:
        with self._lock:
            return len(self._programs)

    def to_file(self, application: str = "") -> CaptureFile:
        """The file of what was built; ``application``: the main script's digest ("":
        none, ``python -c``)."""
        launched = self._launched() if self._launched is not None else {}
        with self._lock:
            programs = tuple(_program(spec, fps, launched)
                             for spec, fps in self._programs.values())
            blobs = {d: Blob.of(b) for d, b in sorted(self._blobs.items())}
        return CaptureFile(programs=programs, blobs=blobs,
                           applications=(application,) if application else ())


def _program(spec: ProgramSpec, fingerprints: set[str], launched: Launches
             ) -> CapturedProgram:
    """A program of a capture: its launches on each of its devices, where any."""
    launches: dict[str, tuple[Launched, ...]] = {}
    for fp in sorted(fingerprints):
        made = [x for pair in sorted(launched.get((spec.key.id_hash, fp), ()))
                if (x := Launched.of(pair)) is not None]
        if made:
            launches[fp] = tuple(made[:MAX_PROGRAM_LAUNCHES])
    return CapturedProgram(spec=spec, fingerprints=tuple(sorted(fingerprints)),
                           launches=launches or None)


def merge(captures: list[CaptureFile]) -> CaptureFile:
    """One capture holding every program (fingerprints and launches joined) and blob of
    ``captures``."""
    programs: dict[str, tuple[ProgramSpec, set[str]]] = {}
    launched: dict[tuple[str, str], set[Pair]] = {}
    blobs: dict[str, Blob] = {}
    apps: dict[str, None] = {}
    for cap in captures:
        apps.update(dict.fromkeys(cap.applications))
        for p in cap.programs:
            _, fps = programs.setdefault(p.spec.key.id_hash, (p.spec, set()))
            fps.update(p.fingerprints)
            for fp in p.launches or {}:
                launched.setdefault((p.spec.key.id_hash, fp), set()).update(p.launched(fp))
        blobs.update(cap.blobs)
    return CaptureFile(programs=tuple(_program(s, f, launched) for s, f in programs.values()),
                       blobs=dict(sorted(blobs.items())),
                       applications=tuple(apps)[:MAX_APPLICATIONS])


def write_capture(path: Path, capture: CaptureFile) -> None:
    """Write ``capture`` to ``path`` atomically (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(capture.model_dump_json(indent=1, exclude_none=True) + "\n")
    tmp.replace(path)


def read_capture(path: Path) -> CaptureFile:
    """The validated capture at ``path``; :class:`CaptureError` in one line otherwise."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # a pipe or a device would be read for ever
            raise CaptureError(f"capture {path}: not a regular file")
        size = info.st_size
        if size > MAX_CAPTURE_BYTES:
            raise CaptureError(f"capture {path}: {size} bytes, over the limit of "
                               f"{MAX_CAPTURE_BYTES}")
        raw = json.loads(path.read_bytes(), parse_int=_bounded_int,
                         parse_constant=_no_constant)
    except OSError as exc:
        raise CaptureError(f"capture {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CaptureError(f"capture {path}: not JSON ({_json_where(exc)}); truncated or "
                           "edited?") from None
    except _Refused as exc:
        raise CaptureError(f"capture {path}: {exc}") from None
    except RecursionError:
        raise CaptureError(f"capture {path}: JSON nested deeper than {MAX_DEPTH}") from None
    if _depth(raw) > MAX_DEPTH:
        raise CaptureError(f"capture {path}: JSON nested deeper than {MAX_DEPTH}")
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CaptureError(f"capture {path}: not a kernel-farm capture (no \"format\": "
                           f"\"{FORMAT}\")")
    version = raw.get("version")
    if type(version) is not int or version != VERSION:
        raise CaptureError(f"capture {path}: format version {version!r}"[:200]
                           + f", this farm reads version {VERSION}")
    launches = _launch_count(raw)
    if launches > MAX_LAUNCHES:
        raise CaptureError(f"capture {path}: {launches} launches, over the limit of "
                           f"{MAX_LAUNCHES}")
    try:
        capture = CaptureFile.model_validate(raw)
    except ValidationError as exc:
        where, msg = first_error(exc, "capture")
        raise CaptureError(f"capture {path}: {where}: {' '.join(msg.split())}"[:500]) from None
    _check_blobs(path, capture)
    return capture


def _check_blobs(path: Path, capture: CaptureFile) -> None:
    for digest, blob in capture.blobs.items():
        try:
            data = blob.data()
        except ValueError as exc:
            raise CaptureError(f"capture {path}: blob {digest}: {exc}") from None
        if sha256_hex(data) != digest:
            raise CaptureError(f"capture {path}: blob {digest} does not hold the bytes its "
                               "digest names (edited by hand?)")
    for i, program in enumerate(capture.programs):
        for fp in program.fingerprints:
            try:
                Namespace.for_fingerprint(fp)
            except ValueError:
                raise CaptureError(f"capture {path}: programs[{i}]: not a device "
                                   f"fingerprint: {fp[:60]!r}") from None
        for fp in program.launches or {}:
            if fp not in program.fingerprints:
                raise CaptureError(f"capture {path}: programs[{i}].launches: {fp[:60]!r} is "
                                   "not a device the program was built for")
        for digest in program.spec.digests():
            if digest not in capture.blobs:
                raise CaptureError(f"capture {path}: programs[{i}] needs blob {digest}, "
                                   "which the capture lacks")
        if program.spec.source_size != len(capture.blob(program.spec.source)):
            raise CaptureError(f"capture {path}: programs[{i}]: source size disagrees "
                               "with its blob")


def _launch_count(raw: dict[str, object]) -> int:
    """How many launches the parsed capture ``raw`` lists (before its models see it)."""
    programs = raw.get("programs")
    total = 0
    for program in programs if isinstance(programs, list) else ():
        launches = program.get("launches") if isinstance(program, dict) else None
        if isinstance(launches, dict):
            total += sum(len(v) for v in launches.values() if isinstance(v, list))
    return total


class _Refused(ValueError):
    """A JSON value past a reader's limit (raised while parsing)."""


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_DIGITS})")
    return int(text)


def _no_constant(text: str) -> float:
    raise _Refused(f"{text} is not a number JSON allows")


def _depth(value: object) -> int:
    """How deep ``value`` (parsed JSON) nests, without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                return depth
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                   else item))
    return deepest


def _json_where(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
    return "not UTF-8"
