"""``tune_job``: one tuning key on this worker's device (the ``farm.tune`` task).

1. the family must be registered here with the build id the client computed (else the
   reply says so, nothing is measured);
2. a key the store holds already is reused (unless ``retune``);
3. each candidate is obtained by the compile rules of any chunk
   (:func:`worker.kernel.obtain_kernel`: loaded, rekeyed or compiled, leases and
   records included), then loaded here: all before the first timed launch;
4. the candidates are checked and timed in this process (:class:`farm.tuning.runner.Tuner`),
   inside the host's isolation: while this process measures a CPU device, the other
   processes of the pool wait before their next compile (``farm.core.isolation``), and
   no two processes measure one device at once;
5. the result is recorded (a Changed ``tune`` record naming the client's build) and
   stored; the reply carries it.

A pool process that dies while measuring (a candidate that crashes the driver) gives
the task back; the deliveries are counted, and past ``FARM_CRASH_LIMIT`` deaths the key
fails instead of killing processes for ever.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from farm.cluster.payloads import KernelRequest
from farm.core.errors import (
    FarmError,
    KernelError,
    LoadError,
    UnsupportedFeature,
    WorkerUnavailable,
)
from farm.core.isolation import HostLock
from farm.core.keys import TASK_STATE_TTL_S, task_deliveries_key
from farm.core.model import ArtifactId
from farm.tuning.payloads import TuneReply, TuneRequest
from farm.tuning.runner import Tuner
from worker.kernel import obtain_kernel

if TYPE_CHECKING:
    import pyopencl as cl

    from worker.state import WorkerState

log = logging.getLogger(__name__)

#: one tuner per pool process (its profiling queue is made once)
_tuners: dict[int, Tuner] = {}


def tune_job(request: TuneRequest, state: WorkerState, task_id: str | None = None
             ) -> TuneReply:
    """Tune ``request``'s key here (see the module docstring)."""
    if request.fingerprint != state.device.fingerprint:
        raise WorkerUnavailable(f"task for fingerprint {request.fingerprint} reached a "
                                f"worker of {state.device.fingerprint}")
    deaths = _deliveries(state, task_id) - 1
    if deaths > state.settings.crash_limit:
        return TuneReply(failure=f"the measuring process died {deaths} times on this key",
                         worker=state.name)
    tuner = _tuner(state)
    tuner.policy = request.policy
    spec = request.spec
    family = state.registry.get(spec.family)
    if family.build_id != spec.build_id:
        return TuneReply(failure=f"{spec.family}: the worker runs build {family.build_id} "
                                 f"of the family, the key is of build {spec.build_id}",
                         worker=state.name)
    if not request.retune:
        found = tuner.stored(spec)
        if found is not None:
            return TuneReply(result=found, reused=True, worker=state.name)
    programs: dict[str, cl.Program | FarmError] = {}
    for artifact in spec.artifacts():
        programs[artifact.id_hash] = _program(state, artifact, spec.build_id, request)

    def program_of(artifact: ArtifactId) -> cl.Program:
        got = programs[artifact.id_hash]
        if isinstance(got, FarmError):
            raise got
        return got

    tuner.program_of = program_of
    try:
        outcome = tuner.tune(spec, retune=request.retune, requested_by=request.requested_by)
    finally:
        try:
            state.send_records()
        except Exception as exc:  # Redis away: the recorder keeps them for the next send
            log.warning("tune records not sent yet (%s)", exc)
    return TuneReply(result=outcome.result, reused=outcome.reused, failure=outcome.failure,
                     worker=state.name)


def _tuner(state: WorkerState) -> Tuner:
    tuner = _tuners.get(id(state))
    if tuner is None:
        tuner = Tuner(registry=state.registry, device=state.device, ctx=state.ctx,
                      cl_device=state.cl_device, store=state.store,
                      program_of=_no_program, recorder=state.recorder,
                      lock=HostLock(state.settings.isolation_dir), worker=state.name)
        _tuners.clear()  # one state per process: a new one replaces the old
        _tuners[id(state)] = tuner
    return tuner


def _no_program(artifact: ArtifactId) -> cl.Program:
    raise FarmError(f"{artifact.kernel.label()}: no program obtained for it")


def _program(state: WorkerState, artifact: ArtifactId, build_id: str,
             request: TuneRequest) -> cl.Program | FarmError:
    """Candidate ``artifact`` obtained by the compile rules and loaded here, or why not."""
    reply = obtain_kernel(KernelRequest(artifact=artifact, build_id=build_id), state,
                          request.requested_by)
    if reply.failure is not None:
        kind = UnsupportedFeature if reply.failure.kind == UnsupportedFeature.kind \
            else KernelError
        return kind(reply.failure.message)
    assert reply.key is not None
    from farm.core.model import Key

    art = state.store.get(state.ns, Key.parse(reply.key))
    if art is None:
        return LoadError("stored, but no longer readable from the store")
    family = state.registry.get(artifact.kernel.family)
    try:
        names = family.lower_id(artifact, state.device).kernel_names
        return state.backend.load(art.binary, names).program
    except FarmError as exc:
        return exc


def _deliveries(state: WorkerState, task_id: str | None) -> int:
    """This task's deliveries so far, this one included (1 without Redis)."""
    if task_id is None or state.redis is None or state.redis_waiter is None:
        return 1
    client = state.redis
    key = task_deliveries_key(task_id)

    def count() -> int:
        pipe = client.pipeline(transaction=False)
        pipe.incr(key)
        pipe.expire(key, TASK_STATE_TTL_S)
        return int(pipe.execute()[0])

    return state.redis_waiter.call(count)
