"""Tuning keys on this process's device: reuse a stored result, or check and time every
candidate, record it, store it.

One :class:`Tuner` serves ``farm tune`` (the candidates' programs from a
``KernelLoader``), a worker's tuning task (from the worker's store and device,
``worker.tune``) and ``KernelLoader.tuned(..., on_miss="tune")``. Where the programs
come from is the caller's (``program_of``): by the time a key is timed every candidate
is built, so no compile runs between two timed launches of this process.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from farm.core.device import DeviceInfo
from farm.core.errors import FarmError, UnsupportedFeature, one_line
from farm.core.isolation import HostLock, resource_of
from farm.core.keys import Namespace
from farm.core.model import ArtifactId, LaunchSettings
from farm.core.outcomes import Fate
from farm.families import Registry
from farm.families.base import Example, KernelFamily
from farm.records.model import RequestedBy, Stamp, TunedCandidate, TuneRecord
from farm.store.base import ArtifactStore
from farm.tuning import store as results
from farm.tuning.keys import TuningSpec, candidate_label
from farm.tuning.model import Figures, MeasurePolicy, TuningResult, fastest, now

if TYPE_CHECKING:
    import pyopencl as cl

    from farm.records import Recorder
    from farm.tuning.measure import Contender

log = logging.getLogger(__name__)

#: the loaded program of a candidate's artifact; raises a FarmError (UnsupportedFeature
#: for a kernel the device cannot run) when there is none
ProgramOf = Callable[[ArtifactId], "cl.Program"]


@dataclass
class TuneOutcome:
    """What became of one key: its result (measured now, or ``reused`` from the store),
    or why it has none (``failure``)."""

    spec: TuningSpec
    result: TuningResult | None = None
    reused: bool = False
    failure: str = ""


@dataclass
class Tuner:
    """Tunes keys on one device through one context (see the module docstring)."""

    registry: Registry
    device: DeviceInfo
    ctx: cl.Context
    cl_device: cl.Device
    store: ArtifactStore
    program_of: ProgramOf
    recorder: Recorder | None = None
    policy: MeasurePolicy = field(default_factory=MeasurePolicy)
    lock: HostLock = field(default_factory=HostLock)
    worker: str = ""
    #: the seed of the example's inputs
    seed: int = 0

    @property
    def ns(self) -> Namespace:
        return Namespace.for_fingerprint(self.device.fingerprint)

    @cached_property
    def queue(self) -> cl.CommandQueue:
        """An in-order queue with profiling: the device's own clock for every launch."""
        import pyopencl as cl

        return cl.CommandQueue(self.ctx, self.cl_device,
                               properties=cl.command_queue_properties.PROFILING_ENABLE)

    def stored(self, spec: TuningSpec) -> TuningResult | None:
        """The stored result of exactly ``spec``, if any."""
        return results.read(self.store, self.ns, spec)

    def tune(self, spec: TuningSpec, *, retune: bool = False,
             requested_by: RequestedBy | None = None) -> TuneOutcome:
        """Reuse ``spec``'s stored result (unless ``retune``), else measure, record and
        store it. A key that cannot be tuned here (another build of the family, no
        example) is an outcome with a ``failure``, never an exception."""
        if not retune:
            found = self.stored(spec)
            if found is not None:
                return TuneOutcome(spec=spec, result=found, reused=True)
        try:
            result = self.measure(spec)
        except FarmError as exc:
            return TuneOutcome(spec=spec, failure=one_line(exc))
        self._record(result, requested_by)
        kept = results.write(self.store, self.ns, result, replace=retune)
        return TuneOutcome(spec=spec, result=kept)

    def measure(self, spec: TuningSpec) -> TuningResult:
        """Check and time every candidate of ``spec`` now (nothing is stored)."""
        from farm.tuning.measure import measure

        family = self.registry.get(spec.family)
        if family.build_id != spec.build_id:
            raise FarmError(f"{spec.family}: the key was made for build {spec.build_id}, "
                            f"this process runs build {family.build_id} of the family")
        start = time.perf_counter()
        example = _example(family, spec, self.seed)
        contenders = [self._contender(family, spec, i, example)
                      for i in range(len(spec.candidates))]
        figures, isolated = measure(self.queue, example, contenders, self.policy,
                                    self.lock.measuring(resource_of(self.device)))
        return TuningResult(spec=spec, fingerprint=self.device.fingerprint,
                            candidates=tuple(figures), winner=fastest(figures),
                            policy=self.policy, isolated=isolated,
                            wall_s=time.perf_counter() - start, measured_at=now(),
                            host=socket.gethostname(), worker=self.worker)

    def _contender(self, family: KernelFamily[Any], spec: TuningSpec, index: int,
                   example: Example) -> Contender:
        import pyopencl as cl

        from farm.tuning.measure import Contender

        params = spec.candidates[index]
        try:
            size, local = _geometry(family, spec, index, example, self.seed)
            program = self.program_of(spec.artifact(index))
            kernel = cl.Kernel(program, example.kernel_name)
        except UnsupportedFeature as exc:
            return Contender(params, status=Fate.UNSUPPORTED, note=one_line(exc)[:500])
        except (FarmError, cl.Error) as exc:
            return Contender(params, status=Fate.FAILED, note=one_line(exc)[:500])
        return Contender(params, kernel=kernel, global_size=size, local_size=local)

    def _record(self, result: TuningResult, requested_by: RequestedBy | None) -> None:
        if self.recorder is None:
            return
        spec = result.spec

        def make(stamp: Stamp) -> TuneRecord:
            return TuneRecord(
                stamp=stamp, family=spec.family, key=str(spec.key()), problem=spec.label(),
                winner=result.winner, candidates=[_line(f) for f in result.candidates],
                work_s=result.wall_s, isolated=result.isolated, worker=self.worker,
                host=result.host, requested_by=requested_by)

        self.recorder.tune(make)


def _line(figures: Figures) -> TunedCandidate:
    return TunedCandidate(params=candidate_label(figures.params), status=figures.status,
                          ms=figures.ms, spread=figures.spread)


def _example(family: KernelFamily[Any], spec: TuningSpec, seed: int) -> Example:
    """The problem's inputs and reference (from the first candidate's parameters: a
    tunable family draws the same inputs for every candidate of a problem)."""
    try:
        example = family.example(family.validate(spec.params(0)), spec.launch,
                                 np.random.default_rng(seed))
    except FarmError:
        raise
    except Exception as exc:  # a family's own code
        raise FarmError(f"{spec.family}: its example() failed: {type(exc).__name__}: "
                        f"{one_line(exc)[:300]}") from None
    if example is None:
        raise FarmError(f"{spec.family}: the family has no example(), so its candidates "
                        "cannot be checked against a reference; nothing was timed")
    return example


def _geometry(family: KernelFamily[Any], spec: TuningSpec, index: int, example: Example,
              seed: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Candidate ``index``'s global and local size: its ready launch (sizes alone), else
    its own example; a FarmError when its buffers are not the problem's."""
    if index == 0:
        return example.global_size, example.local_size
    params = family.validate(spec.params(index))
    launch: LaunchSettings = spec.launch
    try:
        ready = family.ready_launch(params, launch)
        if ready is None:
            own = family.example(params, launch, np.random.default_rng(seed))
            if own is None:
                raise FarmError("the family has no example for this candidate")
            ready = own.ready_launch()
    except FarmError:
        raise
    except Exception as exc:  # a family's own code
        raise FarmError(f"its launch could not be made: {type(exc).__name__}: "
                        f"{one_line(exc)[:300]}") from None
    want = [a.nbytes for a in example.ready_launch().args if a.kind == "buffer"]
    have = [a.nbytes for a in ready.args if a.kind == "buffer"]
    if want != have or ready.kernel_name != example.kernel_name:
        raise FarmError("its launch does not take the problem's buffers")
    return ready.global_size, ready.local_size
