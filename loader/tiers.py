"""The store tiers a loader walks, and the one seam that puts a binary on the device.

A :class:`TierFetcher` walks the tiers front to back: get (every tier verifies the
digest), load, and copy a later tier's hit into the tiers in front of it *after* it
loaded, so the next process on this machine needs no network and a binary this device
refused is never copied.

Two rules guard the process that loads (docs/SECURITY.md, "One trust rule for every
stored binary"): every artifact is proven on this node before this process loads it,
in a child process with a private driver cache (:mod:`farm.compilation.proofs`; the
node's book answers for those proven before, so a warm node pays a ``stat``), whatever
its origin (an ``imported`` one is then noted ``validated`` in its tier); and an
artifact this device refuses, or that kills the child, is proven bad on its own device:
it is quarantined (moved aside with why, its bytes kept), so that the kernel's repair
can be stored instead of being refused by first-writer-wins for ever.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from farm.compilation.load import LoadedBinary
from farm.compilation.load import load_binary as load_artifact
from farm.core.errors import FarmError, LoadError
from farm.core.keys import Namespace
from farm.core.model import Artifact, ArtifactId, Key
from farm.store import ArtifactStore
from farm.store.base import mark_validated, set_aside
from farm.store.tiers import Tier, TierName, tiers_of
from loader.programs import LoadedProgram

if TYPE_CHECKING:
    import pyopencl as cl

    from farm.core.device import DeviceContext

log = logging.getLogger(__name__)

__all__ = ["Tier", "TierFetcher", "TierName", "load_binary", "tiers_of"]

#: what filling a front tier may raise; the load that was served still stands
_FILL_FAILURES = (FarmError, OSError, sqlite3.Error)


def load_binary(ctx: cl.Context, device: cl.Device, binary: bytes,
                arch: str = "", kernel_names: tuple[str, ...] = ()) -> LoadedBinary:
    """The program of a binary (a native artifact's machine code first, its portable
    part when the device refuses that), holding exactly ``kernel_names`` (the family's
    declaration); :class:`LoadError` when nothing loads.

    The one seam through which the loader puts a binary on the device (tests count it).
    """
    return load_artifact(ctx, device, binary, kernel_names, arch=arch)


#: the kernel names a family declares for an artifact id (its lowering's)
Declared = Callable[[ArtifactId], tuple[str, ...]]
#: proves a stored artifact in an isolated process (the node's verdict first): "" when
#: it loads holding exactly the names given, else why not
Isolate = Callable[[Artifact, tuple[str, ...]], str]


class TierFetcher:
    """Fetches an artifact from the first tier that holds one this device loads.

    ``count`` receives the names of what happened (``loads``, ``native_fallbacks``) for
    the loader's statistics; ``declared`` gives the kernel names the family declares,
    the only ones a binary served for that kernel may hold; ``isolate`` proves a binary
    in a child process before it is loaded here.
    """

    def __init__(self, store: ArtifactStore, namespace: Namespace, context: DeviceContext,
                 count: Callable[[str], None], declared: Declared,
                 isolate: Isolate) -> None:
        self.tiers = tiers_of(store)
        self.namespace = namespace
        self._context = context
        self._count = count
        self._declared = declared
        self._isolate = isolate

    def read(self, tier: int, key: Key) -> tuple[Artifact | None, float]:
        """Tier ``tier``'s artifact for ``key`` (verified by the tier), and the read's
        time: what a warm reads ahead while the device's context is being made."""
        t = time.perf_counter()
        art = self.tiers[tier].store.get(self.namespace, key)
        return art, time.perf_counter() - t

    def fetch_and_load(self, artifact: ArtifactId, key: Key, first_tier: int = 0,
                       timings: dict[str, float] | None = None,
                       prefetched: tuple[Artifact | None, float] | None = None
                       ) -> tuple[LoadedProgram, Tier] | None:
        """Walk the tiers from ``first_tier``: get (verified), load, then copy into the
        tiers in front. ``None`` when no tier holds a binary this device accepts.

        ``timings`` (when given) receives ``fetch_s`` and ``load_s``; ``prefetched`` is
        ``first_tier``'s answer already read (and its time), which is then not read again.
        """
        fetch_s = load_s = 0.0
        try:
            names = self._declared(artifact)
        except FarmError as exc:  # the compile path reports it, for this kernel
            log.info("loader: %s declares no kernels here (%s); a miss",
                     artifact.kernel.label(), exc)
            return None
        try:
            for i in range(first_tier, len(self.tiers)):
                tier = self.tiers[i]
                if prefetched is not None and i == first_tier:
                    art, read_s = prefetched
                else:
                    art, read_s = self.read(i, key)
                fetch_s += read_s
                if art is None:
                    continue
                if not art.verify() or art.meta.key != key:  # a store that did not verify
                    log.warning("loader: %s tier returned %s failing its digest; a miss",
                                tier.name, key)
                    continue
                t = time.perf_counter()
                checked = self._validated(tier, art, names)
                if checked is None:
                    load_s += time.perf_counter() - t
                    continue
                art = checked
                try:
                    ctx, cl_device = self._context.get()
                    loaded = load_binary(ctx, cl_device, art.binary,
                                         self._context.info.native_arch, names)
                except LoadError as exc:
                    load_s += time.perf_counter() - t
                    log.warning("loader: %s refused by the device (%s); a miss", key, exc)
                    self._count("quarantined")
                    set_aside(tier.store, self.namespace, art,
                              f"the device refused it: {exc}")
                    continue
                load_s += time.perf_counter() - t
                self._count("loads")
                if loaded.fallback:
                    self._count("native_fallbacks")
                self._fill_front(i, art)
                entry = LoadedProgram(program=loaded.program, kernel_names=loaded.names,
                                      family=artifact.kernel.family, key=key,
                                      native_fallback=loaded.fallback)
                return entry, tier
            return None
        finally:
            if timings is not None:
                timings["fetch_s"] = fetch_s
                timings["load_s"] = load_s

    def _validated(self, tier: Tier, art: Artifact, names: tuple[str, ...]
                   ) -> Artifact | None:
        """``art`` once proven on this node (an imported one noted as validated in its
        tier); ``None`` (quarantined) when the child could not load it."""
        try:
            why = self._isolate(art, names)
        except FarmError as exc:  # no child here: the binary is not loaded unchecked
            log.warning("loader: %s was not validated here (%s); a miss", art.meta.key, exc)
            return None
        if why:
            log.warning("loader: %s (%s) failed validation in a child process: %s",
                        art.meta.key, art.meta.origin, why)
            self._count("quarantined")
            set_aside(tier.store, self.namespace, art, why)
            return None
        if art.meta.origin != "imported":
            return art
        self._count("validated")
        return mark_validated(tier.store, self.namespace, art)

    def _fill_front(self, index: int, art: Artifact) -> None:
        """Copy a hit of tier ``index`` into the tiers in front of it (after its load)."""
        for front in self.tiers[:index]:
            try:
                front.store.put(self.namespace, art)
            except _FILL_FAILURES as exc:
                log.warning("loader: could not copy %s into %s (%s)", art.meta.key,
                            front.store.location, exc)
