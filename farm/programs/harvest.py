"""Harvesting the work-group functions an application's launches made on PoCL, and
storing the new ones beside their program (:mod:`farm.programs.supplements`).

Nothing is done at launch time: the application's launches are never hooked or slowed.
A work-group function exists only once a launch has *executed* (PoCL makes it when the
command runs), so the harvest looks afterwards, at what the program's folder holds
(:func:`farm.compilation.poclcache.work_group_functions`: one directory listing per
kernel), on a background thread every :data:`INTERVAL_S` seconds and once more when the
process ends (:meth:`Harvester.close`, which the hook calls at exit). Only pairs the
program's binary did not carry are read, checked
(:func:`farm.compilation.elfstub.exports`) and stored, in as few records as their size
allows; before writing a slot the harvest reads it, so what another process stored
meanwhile is not stored twice.

What it stores is only what PoCL made in this node from a binary the node proved: the
folder it reads is the one of the binary the application loaded, named by that binary's
own content (:func:`farm.programs.prepared.merge`), so nothing in it came from another
binary, and what the binary itself carried (records merged in) is known and never
stored again. :func:`store_functions` is the one writer of records; a build process that
made functions by launching recorded settings calls it with those launches.

With PoCL's kernel cache off, PoCL deletes a program's folder when the program is
released, so the harvester keeps the programs it watches alive until the last harvest
(at most :data:`MAX_HELD`; a process that makes more than that has the later ones
harvested while they live).
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path

from farm.compilation.elfstub import exports
from farm.compilation.poclcache import loaded_folder, work_group_functions
from farm.compilation.proofs import Claim, ProofBook
from farm.core.errors import FarmError
from farm.core.keys import PROGRAM_FUNCTION_SLOTS, Namespace, program_functions_key
from farm.programs.headers import MAX_FUNCTIONS, MAX_RECORD_BYTES, SupplementError
from farm.programs.prepared import Pair, Prepared

#: typing.TYPE_CHECKING without importing typing: a served process imports this module
#: at its first PoCL build, and the records' models, the store and the MinIO SDK only
#: when a harvest has something to store (:func:`store_functions`)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from farm.core.model import Artifact, Key, ReadyLaunch
    from farm.store.base import ArtifactStore

#: seconds between two harvests of a running process
INTERVAL_S = 20.0
#: programs kept alive for the last harvest, at most
MAX_HELD = 1024
#: seconds the last harvest waits for one in progress on the thread
_JOIN_S = 30.0
_UNAVAILABLE = (FarmError, OSError, sqlite3.Error)


@dataclass
class Watched:
    """One program (per fingerprint) this process loaded, as the harvest sees it."""

    ns: Namespace
    #: the program's key, as text (``id.build``: its model is loaded only to store)
    program: str
    prepared: Prepared
    #: the program artifact's source hash (a record names the same spec)
    source_hash: str
    #: the program artifact's digest (a record is proven merged into it)
    program_digest: str = ""
    folder: Path | None = None
    #: the built programs kept alive until the last harvest (only held, never used)
    held: list[object] = field(default_factory=list)
    #: every (kernel, specialisation) its folder was seen to hold
    seen: set[Pair] = field(default_factory=set)


class Harvester:
    """Watches the programs a :class:`~farm.programs.serve.ProgramServer` served on PoCL
    and stores the work-group functions their launches made. Thread-safe."""

    def __init__(self, store: Callable[[], ArtifactStore], warn: Callable[[str], None],
                 interval: float = INTERVAL_S, book: ProofBook | None = None) -> None:
        """``book``: the node's proof book, where what this harvest stores is noted as
        proven on this node (PoCL made and ran these functions here, from a binary the
        node proved: the next process merges them without a child)."""
        self._store = store
        self._warn = warn
        self._book = book
        self._interval = interval
        self._lock = threading.Lock()  # the watch list
        self._harvesting = threading.Lock()  # one harvest at a time
        self._watched: dict[tuple[Namespace, str], Watched] = {}
        self._held = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: functions stored by this process (for tests and summaries)
        self.stored = 0

    def watch(self, ns: Namespace, program: str, prepared: Prepared, source_hash: str,
              handle: object, program_digest: str = "") -> None:
        """Harvest ``program`` (its key as text; loaded from ``prepared``; ``handle`` its
        built program; ``program_digest``: its artifact's)."""
        with self._lock:
            w = self._watched.get((ns, program))
            if w is None:
                w = self._watched[(ns, program)] = Watched(ns, program, prepared, source_hash,
                                                           program_digest)
            if self._held < MAX_HELD:
                w.held.append(handle)
                self._held += 1
            if self._thread is None and self._interval > 0:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="kernel-farm harvest")
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.harvest()

    def close(self) -> int:
        """The last harvest; then let the programs go. Returns functions stored in all."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(_JOIN_S)
        self.harvest()
        with self._lock:
            for w in self._watched.values():
                w.held.clear()
            self._watched.clear()
        return self.stored

    def launched(self) -> dict[tuple[str, str], set[Pair]]:
        """(program key's id hash, fingerprint) -> every work-group function its folder
        held, now or at an earlier harvest: those its launches made here, and those it
        was served with (launches of earlier runs on that device). What a capture records
        (:mod:`farm.programs.capture`); a directory listing per kernel, nothing more."""
        with self._lock:
            watched = list(self._watched.values())
        out: dict[tuple[str, str], set[Pair]] = {}
        with self._harvesting:
            for w in watched:
                _look(w)
                out.setdefault((w.program.partition(".")[0], w.ns.fingerprint),
                               set()).update(w.seen)
        return out

    def harvest(self) -> int:
        """Store what the watched programs' folders hold that their binaries did not;
        returns how many functions were stored."""
        with self._lock:
            watched = list(self._watched.values())
        stored = 0
        with self._harvesting:
            for w in watched:
                new = _new_functions(w)
                if new:
                    try:
                        stored += self._store_new(w, new)
                    except _UNAVAILABLE as exc:
                        self._warn("work-group functions not stored "
                                   f"({' '.join(str(exc).split())[:200]})")
                        break
            self.stored += stored
        return stored

    def _store_new(self, w: Watched, new: dict[Pair, bytes]) -> int:
        """Put ``new`` into the program's next free slots (see :func:`store_functions`)."""
        from farm.core.model import Key

        prep = w.prepared
        made = Made(program=Key.parse(w.program), base=prep.base, kernels=frozenset(prep.kernels),
                    source_hash=w.source_hash)
        done = store_functions(self._store(), w.ns, made, new, first_slot=prep.next_slot,
                               noted=lambda art: self._note(w, art))
        prep.known.update(done.known)
        prep.next_slot = done.next_slot
        return done.stored


    def _note(self, w: Watched, art: Artifact) -> None:
        """A record this harvest stored, noted as proven merged into its program."""
        if self._book is not None and w.program_digest:
            self._book.note(Claim("functions", w.ns.fingerprint, art.meta.digest,
                                  merged=(w.program_digest,)), "")


@dataclass(frozen=True)
class Made:
    """What work-group functions were made from: a program's validated binary (named
    ``base``, holding ``kernels``) and its artifact's source hash (a record names the
    same spec)."""

    program: Key
    base: str
    kernels: frozenset[str]
    source_hash: str


@dataclass
class Stored:
    """What :func:`store_functions` did: functions stored, the pairs the program's
    records now hold, and the first slot it did not look at."""

    stored: int = 0
    known: set[Pair] = field(default_factory=set)
    next_slot: int = 0


def store_functions(store: ArtifactStore, ns: Namespace, made: Made,
                    functions: Mapping[Pair, bytes], *, first_slot: int = 0,
                    launches: Mapping[Pair, ReadyLaunch] | None = None,
                    noted: Callable[[Artifact], None] | None = None) -> Stored:
    """Store ``functions``, made on ``ns``'s device by PoCL from the binary ``made``
    names, in the program's free record slots from ``first_slot`` on, as few records as
    their size allows; ``launches``: the launch that made a function, where the maker
    knows it (a build that launched recorded settings: the records' proofs then run
    them).

    Who may call it: a process that made these functions itself, from a binary it loaded
    after its proof (a harvest of an application's launches, or a build process that
    launched them). Before writing a slot it reads it: what another process stored there
    meanwhile is not stored twice. ``noted`` is told of each record stored."""
    from farm.programs.supplements import read_slot, record
    from farm.store.base import PutResult

    out = Stored(next_slot=first_slot)
    new = dict(functions)
    rounds = 2 * PROGRAM_FUNCTION_SLOTS  # a slot refused and then not found, forever
    while new and out.next_slot < PROGRAM_FUNCTION_SLOTS and rounds > 0:
        rounds -= 1
        slot = out.next_slot
        there = store.get(ns, program_functions_key(made.program, slot))
        if there is not None:
            try:
                held = set(read_slot(there, made.program, made.base, ns.fingerprint, slot,
                                     made.kernels).functions)
            except SupplementError:
                held = set()
            out.known.update(held)
            new = {p: d for p, d in new.items() if p not in held}
            out.next_slot += 1
            continue
        chunk = _chunk(new)
        art = record(made.program, made.base, ns.fingerprint, slot, chunk, made.source_hash,
                     {p: launch for p, launch in (launches or {}).items() if p in chunk})
        if store.put(ns, art) is PutResult.REFUSED:
            continue  # another harvest took the slot: read it next round
        if noted is not None:
            noted(art)
        out.known.update(chunk)
        out.next_slot += 1
        out.stored += len(chunk)
        new = {p: d for p, d in new.items() if p not in chunk}
    return out


def _look(w: Watched) -> dict[Pair, Path]:
    """What ``w``'s folder holds now (noted in ``w.seen``)."""
    if w.folder is None:
        w.folder = loaded_folder(w.prepared.folder)
        if w.folder is None:
            return {}
    found = work_group_functions(w.folder, w.prepared.kernels)
    w.seen.update(found)
    return found


def _new_functions(w: Watched) -> dict[Pair, bytes]:
    """The functions ``w``'s folder holds that its binary did not, checked."""
    found = _look(w)
    out: dict[Pair, bytes] = {}
    for pair, path in sorted(found.items()):
        if pair in w.prepared.known:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue  # released meanwhile (PoCL's cache off): nothing to keep
        if exports(data, pair[0]):
            out[pair] = data
    return out


def _chunk(new: dict[Pair, bytes]) -> dict[Pair, bytes]:
    """As many of ``new`` as one record holds (at least one)."""
    out: dict[Pair, bytes] = {}
    size = 0
    for pair, data in sorted(new.items()):
        if out and (len(out) >= MAX_FUNCTIONS or size + len(data) > MAX_RECORD_BYTES):
            break
        out[pair] = data
        size += len(data)
    return out
