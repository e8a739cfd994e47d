"""What a loader keeps in memory, and the trips in flight to fill it.

:class:`InFlight` is the one table both ways of asking use: one kernel at a time
(``KernelLoader.kernel``) and a whole manifest (``warm``). Memory is keyed by
(generation, key) in a :class:`~farm.core.generation.GenerationCache`, so an environment
switch empties it; a key being fetched by one thread is a future the others wait on, so
a kernel asked for by several threads at once is fetched and loaded once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from farm.core.errors import KernelError
from farm.core.generation import GenerationCache, generation
from farm.core.model import Key
from farm.core.outcomes import Fate, Outcome

if TYPE_CHECKING:
    import pyopencl as cl

#: a key under the generation it was loaded in
CacheKey = tuple[int, Key]

class Source(StrEnum):
    """Where a loader got a kernel: memory, a store tier, compiled or rekeyed here, the
    farm (each also the name of a :class:`~loader.base.LoaderStats` counter)."""

    MEMORY = "memory"
    LOCAL = "local"
    REMOTE = "remote"
    COMPILED = Fate.COMPILED.value
    REKEYED = Fate.REKEYED.value
    FARM = "farm"


SOURCES = tuple(Source)


def source_of(outcome: Outcome | None) -> Source:
    """The loader's counter for a kernel its batch obtained (the one mapping of an
    outcome to where the kernel came from: a batch's Loaded is the local store's)."""
    if outcome is Outcome.COMPILED:
        return Source.COMPILED
    if outcome is Outcome.REKEYED:
        return Source.REKEYED
    return Source.LOCAL


@dataclass(frozen=True)
class LoadedProgram:
    """What the memory cache keeps for a key: the program and its kernels' names."""

    program: cl.Program
    kernel_names: tuple[str, ...]
    family: str
    key: Key
    #: why the artifact's machine code was refused and its portable part loaded
    native_fallback: str = ""

    @classmethod
    def of(cls, program: cl.Program, family: str, key: Key) -> LoadedProgram:
        """The entry of a program a batch loaded (its kernels' names read from it)."""
        from farm.compilation.load import program_kernels

        return cls(program=program, family=family, key=key,
                   kernel_names=program_kernels(program))


class InFlight:
    """Programs in memory, and the trips in flight for those that are not. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: GenerationCache[CacheKey, LoadedProgram] = GenerationCache()
        self._inflight: dict[CacheKey, Future[LoadedProgram]] = {}

    @staticmethod
    def key(key: Key) -> CacheKey:
        """``key`` under the current generation."""
        return (generation(), key)

    def get(self, ck: CacheKey) -> LoadedProgram | None:
        """The program in memory, if any."""
        return self._cache.get(ck)

    def lead(self, ck: CacheKey) -> tuple[LoadedProgram | None, Future[LoadedProgram]
                                          | None, bool]:
        """(memory hit, future, leader): a hit; or the future of another thread's trip
        to wait on (leader False); or a new future this caller must :meth:`settle`."""
        with self._lock:
            hit = self._cache.get(ck)
            if hit is not None:
                return hit, None, False
            fut = self._inflight.get(ck)
            if fut is not None:
                return None, fut, False
            fut = self._inflight[ck] = Future()
            return None, fut, True

    def claim(self, cks: Iterable[CacheKey]
              ) -> tuple[dict[CacheKey, Future[LoadedProgram]],
                         dict[CacheKey, Future[LoadedProgram]]]:
        """Register in-flight futures for the keys nobody is fetching; return (claimed,
        joined): the futures this caller must settle, and others' to wait on."""
        claimed: dict[CacheKey, Future[LoadedProgram]] = {}
        joined: dict[CacheKey, Future[LoadedProgram]] = {}
        with self._lock:
            for ck in cks:
                fut = self._inflight.get(ck)
                if fut is not None:
                    joined[ck] = fut
                else:
                    fut = Future()
                    self._inflight[ck] = fut
                    claimed[ck] = fut
        return claimed, joined

    def settle(self, ck: CacheKey, fut: Future[LoadedProgram], entry: LoadedProgram | None,
               error: BaseException | None = None) -> None:
        """Finish a claimed trip: keep the entry (or pass the error on), release."""
        if entry is not None:
            self._cache.put(ck, entry)
            fut.set_result(entry)
        else:
            fut.set_exception(error or KernelError("not obtained"))
        with self._lock:
            self._inflight.pop(ck, None)
