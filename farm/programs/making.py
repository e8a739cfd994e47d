"""Ready from a capture: the work-group functions a capture's launches need, made where
the capture is built and stored beside each program (PoCL's CPU drivers).

A capture (:mod:`farm.programs.capture`) names, per program and device, the work-group
functions the program's launches needed there (kernel, local size, zero offset, grid
class). ``farm build CAPTURE`` (here, or on a worker with ``--cluster``) then, for each
program of the device whose records do not hold them all:

1. reads the stored program, checks that its body names this key and device and that
   its binary walks (:func:`farm.programs.proving.structure`), and reads its records
   (:func:`farm.programs.supplements.read_records`): what they hold is not made again;
2. makes the others in an isolated child (:class:`farm.compilation.specialize.
   FunctionMaker`) that first loads the binary holding exactly the kernels its body
   names: the functions are made from a binary validated in the process that makes
   them, with a private PoCL cache, launching nothing;
3. stores them through the harvest's one writer (:func:`farm.programs.harvest.
   store_functions`), as records of the binary they were made from, which a node then
   proves and merges like any harvested record (docs/PYOPENCL.md).

A launch that names a kernel the program lacks is ignored (counted), as is one whose
function is already held.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from farm.compilation.poclbin import PoclBinaryError, build_hash
from farm.compilation.specialize import (
    MAX_SPECS,
    FunctionMaker,
    Pair,
    Specialized,
    wanted_specs,
)
from farm.compilation.validate import ValidatorError
from farm.core.errors import FarmError
from farm.core.keys import Namespace
from farm.core.model import Artifact, Key
from farm.core.outcomes import Fate
from farm.programs.body import Body, BodyError, read_body
from farm.programs.harvest import Made, store_functions
from farm.programs.proving import structure
from farm.programs.supplements import SlotReader, read_records
from farm.store.tiers import tiers_of

if TYPE_CHECKING:
    from farm.core.device import DeviceInfo
    from farm.programs.capture import CaptureFile
    from farm.store.base import ArtifactStore


@dataclass
class Readiness:
    """What was made of a capture's launches for one device (or one program)."""

    #: programs with launches recorded for the device
    programs: int = 0
    #: work-group functions made and stored now
    made: int = 0
    #: functions the program's records held already
    held: int = 0
    #: launches naming a kernel the program lacks (ignored)
    ignored: int = 0
    #: (program key, why) of each program whose functions were not all made
    failed: list[tuple[str, str]] = field(default_factory=list)
    #: seconds from the build's start to the last function stored (a local build)
    wall_s: float = 0.0

    def add(self, other: Readiness) -> None:
        self.programs += other.programs
        self.made += other.made
        self.held += other.held
        self.ignored += other.ignored
        self.failed.extend(other.failed)

    def summary(self) -> dict[str, Any]:
        return {"programs": self.programs, "made": self.made, "held": self.held,
                "ignored": self.ignored, "wall_s": round(self.wall_s, 3),
                Fate.FAILED: [{"key": k, "message": why} for k, why in self.failed]}


def wanted(capture: CaptureFile, fingerprint: str) -> dict[str, frozenset[Pair]]:
    """Program key's id hash -> the functions the capture's launches needed on
    ``fingerprint`` (programs with none left out)."""
    out: dict[str, set[Pair]] = {}
    for p in capture.programs:
        pairs = p.launched(fingerprint)
        if pairs:
            out.setdefault(p.spec.key.id_hash, set()).update(pairs)
    return {k: frozenset(v) for k, v in out.items()}


@dataclass
class Coverage:
    """A stored program and what its records hold of the functions wanted."""

    art: Artifact | None = None
    body: Body | None = None
    #: wanted functions the records hold
    held: set[Pair] = field(default_factory=set)
    #: wanted functions the records lack, of kernels the program has
    missing: set[Pair] = field(default_factory=set)
    #: wanted functions of kernels the program lacks
    ignored: set[Pair] = field(default_factory=set)
    #: the first record slot no reader found
    next_slot: int = 0
    #: why it cannot be told ("" when it can)
    why: str = ""


def coverage(store: ArtifactStore, ns: Namespace, key: Key, want: frozenset[Pair]
             ) -> Coverage:
    """What ``store`` holds of ``key``'s program and of the functions ``want``."""
    art = store.get(ns, key)
    if art is None:
        return Coverage(why="the program is not in the store")
    try:
        body = read_body(art.binary, key, ns.fingerprint)
    except BodyError as exc:
        return Coverage(art=art, why=f"the stored program is refused: {exc}")
    try:
        base = build_hash(body.binary)
    except PoclBinaryError as exc:
        return Coverage(art=art, why=f"the stored program does not walk: {exc}")
    kernels = frozenset(body.kernels)
    found = read_records(SlotReader(tiers_of(store), ns, key), key, base, ns.fingerprint,
                         kernels)
    if found.unread:
        return Coverage(art=art, body=body, why=found.unread)
    held = {p for c in found.candidates for p in c.decoded.functions}
    return Coverage(art=art, body=body, held=held & want,
                    missing={p for p in want - held if p[0] in kernels},
                    ignored={p for p in want if p[0] not in kernels},
                    next_slot=found.next_slot)


class Makers:
    """The function makers of one device, at most ``size`` children at once, each started
    with ``specs`` (the specialisations the build needs, when known: a request needing
    others gets a child started with them too). Thread-safe."""

    def __init__(self, device: DeviceInfo, specs: frozenset[str] = frozenset(),
                 size: int = 1) -> None:
        self.device = device
        self._specs = specs if len(specs) <= MAX_SPECS else frozenset()
        self._idle: queue.Queue[FunctionMaker | None] = queue.Queue()
        for _ in range(max(1, size)):
            self._idle.put(None)
        self._all: list[FunctionMaker] = []
        self._lock = threading.Lock()

    def make(self, binary: bytes, kernels: tuple[str, ...], want: set[Pair]) -> Specialized:
        """:meth:`FunctionMaker.make` on an idle child that has the specialisations."""
        maker = self._idle.get()
        try:
            needed = wanted_specs(want)
            if maker is None or not needed <= maker.specs:
                if maker is not None:
                    maker.close()
                grown = (maker.specs if maker is not None else self._specs) | needed
                maker = FunctionMaker(self.device, grown if len(grown) <= MAX_SPECS
                                      else needed)
                with self._lock:
                    self._all.append(maker)
            return maker.make(binary, kernels, want)
        finally:
            self._idle.put(maker)

    def kill(self) -> None:
        """End every child now, mid-request too (that request answers that it died)."""
        with self._lock:
            makers = list(self._all)
        for maker in makers:
            maker.kill()

    def close(self) -> None:
        with self._lock:
            makers, self._all = self._all, []
        for maker in makers:
            maker.close()


def make_ready(store: ArtifactStore, info: DeviceInfo, key: Key, want: frozenset[Pair],
               makers: Makers) -> Readiness:
    """Make and store the functions ``want`` of ``key``'s stored program on ``info``'s
    device that its records lack (see the module docstring); what could not be made is
    in the answer's ``failed``, never raised."""
    out = Readiness(programs=1)
    try:
        _make_ready(store, info, key, want, makers, out)
    except (FarmError, OSError, sqlite3.Error, ValidatorError) as exc:
        out.failed.append((str(key), f"not made: {' '.join(str(exc).split())[:200]}"))
    return out


def _make_ready(store: ArtifactStore, info: DeviceInfo, key: Key, want: frozenset[Pair],
                makers: Makers, out: Readiness) -> None:
    ns = Namespace.for_fingerprint(info.fingerprint)
    cov = coverage(store, ns, key, want)
    out.held, out.ignored = len(cov.held), len(cov.ignored)
    why = cov.why or (structure(cov.body.binary, info) if cov.body is not None else "")
    if why:
        out.failed.append((str(key), why))
        return
    if not cov.missing:
        return
    assert cov.art is not None and cov.body is not None
    made = makers.make(cov.body.binary, cov.body.kernels, cov.missing)
    if made.error:
        out.failed.append((str(key), f"its work-group functions were not made: {made.error}"))
        return
    done = store_functions(store, ns, Made(program=key, base=build_hash(cov.body.binary),
                                           kernels=frozenset(cov.body.kernels),
                                           source_hash=cov.art.meta.source_hash),
                           made.functions, first_slot=cov.next_slot)
    out.made = done.stored
    out.held += len(cov.missing & done.known) - done.stored  # another writer's, meanwhile
    lost = sorted("/".join(p) for p in cov.missing - done.known)
    if lost:
        out.failed.append((str(key), f"{len(lost)} work-group function(s) not made or not "
                                     f"stored: {', '.join(lost)}"[:300]))
