"""``KernelLoader.tuned``: the winner of a problem's tuning, loaded, with no timing here.

A node serves the kernel the fleet measured for its device: the problem's latest result
is read from memory, the local tier or MinIO (:func:`farm.tuning.store.read_latest`:
digest, signature and the result's own checks), and the winner's kernel comes through
the loader like any kernel. Nothing is launched to decide; the timing code is not even
imported.

When this device never tuned the problem, ``on_miss`` decides (default
``FARM_TUNE_ON_MISS``, itself ``first``):

* ``first``: the first candidate (the family's default tiles, or the first of the
  ``candidates`` given), with one warning per problem and loader;
* ``tune``: measure the candidates here, now (:class:`farm.tuning.runner.Tuner`: they
  are built or loaded first, then checked and timed in isolation), store the result
  for every other node, and serve the winner;
* ``fail``: raise :class:`~loader.errors.TuningMissing`.

With ``candidates`` the answer is the tuning of exactly that list (a manifest's); without,
the problem's latest tuning, whatever list it was made from.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from farm.core.errors import KernelError, SettingsError
from farm.core.generation import GenerationCache
from farm.core.model import LaunchSettings, Variant
from farm.tuning import store as results
from farm.tuning.keys import TuningSpec, spec_for
from farm.tuning.model import TuningResult
from loader.errors import TuningMissing
from loader.warming import warm_loader

if TYPE_CHECKING:
    import pyopencl as cl

    from loader.base import LoaderBase

log = logging.getLogger(__name__)

TuneOnMiss = Literal["first", "tune", "fail"]


@dataclass(frozen=True)
class Tuned:
    """A problem's kernel to launch: ``kernel`` (a fresh ``pyopencl.Kernel``, loaded),
    ``params`` (its full parameters: the problem's and the winner's tuning ones),
    ``result`` (the tuning it comes from; ``None`` for an untuned first candidate)."""

    kernel: cl.Kernel
    params: dict[str, Any]
    family: str
    result: TuningResult | None

    @property
    def tuned(self) -> bool:
        """Whether ``params`` are a measured winner (not the untuned first candidate)."""
        return self.result is not None


@dataclass(frozen=True)
class _Choice:
    """The candidate ``index`` of ``spec`` to launch, and the tuning that chose it."""

    spec: TuningSpec
    index: int
    result: TuningResult | None


class Tunings:
    """A loader's tuned problems in memory (per generation: an environment switch
    forgets them) and the way to a choice on a miss."""

    def __init__(self, loader: LoaderBase) -> None:
        self.loader = loader
        self._memory: GenerationCache[tuple[str, ...], _Choice] = GenerationCache()
        self._lock = threading.Lock()

    def tuned(self, family: str, problem: Mapping[str, Any], *,
              candidates: Sequence[Mapping[str, Any]] | None = None,
              launch: LaunchSettings | None = None, variant: Variant | None = None,
              on_miss: TuneOnMiss | None = None) -> Tuned:
        loader = self.loader
        miss = on_miss or loader.settings.tune_on_miss
        if miss not in ("first", "tune", "fail"):
            raise SettingsError(f"on_miss must be 'first', 'tune' or 'fail', not {miss!r}")
        # without candidates, the problem's latest tuning: the key needs no candidate
        # list, so only the first is validated unless this one tunes
        spec = spec_for(loader.registry, family, problem, candidates=candidates,
                        launch=launch, variant=variant, first_only=candidates is None)
        ident = (str(spec.index_key()), spec.candidates_digest if candidates else "")
        choice = self._memory.get(ident)
        if choice is None or (choice.result is None and miss != "first"):
            with self._lock:  # one look-up (and one warning, one tuning) per problem
                choice = self._memory.get(ident)
                if choice is None or (choice.result is None and miss != "first"):
                    whole = spec if candidates is not None else spec_for(
                        loader.registry, family, problem, launch=launch, variant=variant) \
                        if miss == "tune" else spec
                    choice = self._choose(spec, whole, exact=candidates is not None,
                                          on_miss=miss)
                    self._memory.put(ident, choice)
        kernel = loader.kernel_for(choice.spec.artifact(choice.index))
        return Tuned(kernel=kernel, params=choice.spec.params(choice.index),
                     family=spec.family, result=choice.result)

    def _choose(self, spec: TuningSpec, whole: TuningSpec, *, exact: bool,
                on_miss: TuneOnMiss) -> _Choice:
        """The choice for ``spec`` (``whole``: with every candidate, to tune)."""
        loader = self.loader
        found = results.read(loader.store, loader.namespace, spec) if exact else \
            results.read_latest(loader.store, loader.namespace, spec)
        if found is None and on_miss == "tune":
            found = self._tune_here(whole)
        if found is None:
            if on_miss == "fail":
                raise TuningMissing(f"{spec.family} {spec.label()}: never tuned on "
                                    f"{loader.namespace} (on_miss='fail'; `farm tune` "
                                    "measures it)")
            log.warning("%s %s: never tuned on this device; launching its first candidate "
                        "(%s) untuned (`farm tune`, or on_miss='tune')", spec.family,
                        spec.label(), " ".join(f"{k}={v}" for k, v in
                                               spec.candidates[0].items()))
            return _Choice(spec=spec, index=0, result=None)
        if found.winner is None:
            raise KernelError(f"{spec.family} {spec.label()}: no candidate of its tuning "
                              "ran right on this device (" + ", ".join(
                                  f.status for f in found.candidates) + ")")
        return _Choice(spec=found.spec, index=found.winner, result=found)

    def _tune_here(self, spec: TuningSpec) -> TuningResult | None:
        """Build what the key lacks, measure it here, store it (see the module doc)."""
        from farm.compilation.finalize import worker_name
        from farm.core.isolation import HostLock
        from farm.tuning.runner import Tuner

        loader = self.loader
        if loader.on_miss != "fail":
            warm_loader(loader, spec.artifacts(), label=f"tune {spec.family}")
        tuner = Tuner(registry=loader.registry, device=loader.device, ctx=loader.context,
                      cl_device=loader.cl_device, store=loader.store,
                      program_of=loader.program_for, recorder=loader.recorder,
                      lock=HostLock(loader.settings.isolation_dir), worker=worker_name())
        outcome = tuner.tune(spec)
        if outcome.result is None:
            log.warning("%s %s: tuning here failed: %s", spec.family, spec.label(),
                        outcome.failure)
        return outcome.result
