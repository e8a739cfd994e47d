"""``execute_job``: the one seam through which a worker obtains a chunk of kernels.

Per kernel, the rules of :mod:`farm.compilation.obtain` (the same as an embedded batch's):

1. the family must be registered here and give the build id the client computed, else
   the kernel fails with a version-skew error naming both ids (``store_key``);
2. lower, then take the compile lease for the source; when another worker holds it,
   wait for it to go and take it, so a kernel in flight in two builds is compiled once.
   Holding it, look once:
3. the key is in the store -> **Loaded** (digest verified, loaded on this device);
4. the source index knows the source -> **Rekeyed** (copy or move);
5. else finalize, load, store -> **Compiled**.

A chunk goes through :mod:`worker.chunkrun` in few round trips (all its leases at once,
its looks at once, its records in one pack, its writes at once, one round trip to end
it): two MinIO requests a compiled kernel (its index entry claimed, its artifact
written) and, for the whole chunk, four Redis round trips (docs/OPERATIONS.md,
"Capacity"). What does not fit (a lease another worker holds, a second kernel of one
source) goes kernel by kernel, through :func:`obtain_kernel` and :class:`WorkerSteps`.

A failing kernel is reported with its build log and nothing of it is stored.

Faults (docs/RELIABILITY.md): a kernel that killed its compiling process ``crash_limit``
times fails as ``crashed`` untouched (``worker.crashes``); Redis and MinIO outages are
waited out up to ``outage_limit`` (``farm.core.outage``). Only a kernel's own failure
(``KernelError``, bad input about it) fails it: an ``InfrastructureError`` (the store,
Redis past the limit, this worker's own state) leaves ``execute_job``, and the task gives
the whole chunk back to its queue for another worker (``worker.app``); that delivery
does not count towards the crash limit. A compile's (or rekey's) record is sent to the
records stream *before* the store is written, so a process killed at any moment never
leaves an artifact whose record never came.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterator

from farm.cluster.payloads import CompileReply, CompileRequest, KernelReply, KernelRequest
from farm.compilation.obtain import compiled_artifact, obtain, store_key
from farm.core.errors import (
    CompileError,
    FarmError,
    InfrastructureError,
    KernelError,
    LoadError,
    WorkerUnavailable,
)
from farm.core.model import Artifact, KernelFailure, Key, Lowered, Outcome
from farm.records.model import RequestedBy, Trip
from worker.chunkrun import ChunkRun
from worker.chunks import Avoided, Delivery, given_up
from worker.crashes import TaskLedger
from worker.state import WorkerState

log = logging.getLogger(__name__)

#: how long to wait for another worker's compile before taking over
LEASE_WAIT_S = 600.0


def execute_job(request: CompileRequest, state: WorkerState,
                task_id: str | None = None, *,
                delivery: Delivery | None = None) -> CompileReply:
    """Obtain every kernel of ``request`` on this worker's device.

    ``delivery`` (the Celery task's, or ``task_id`` alone) turns on crash-loop
    bookkeeping (``TaskLedger``), the check that the chunk's client is alive, and the
    reply onto the build's reply stream (``delivery.pushed`` says whether it got there).
    Raises :class:`InfrastructureError` when the chunk cannot be built here for reasons
    that are not its kernels' (see the module docstring), ``Avoided`` when its client
    sends this worker no more of its build."""
    if request.fingerprint != state.device.fingerprint:
        raise WorkerUnavailable(f"task for fingerprint {request.fingerprint} reached a "
                                f"worker of {state.device.fingerprint}")
    if delivery is None and task_id is not None:
        delivery = Delivery(task_id=task_id, build=request.build)
    ledger = None
    if delivery is not None and state.redis is not None and state.redis_waiter is not None:
        ledger = TaskLedger(state.redis, delivery.task_id, state.redis_waiter,
                            state.settings.crash_limit, delivery.redelivered)
        ledger.start()
    state.ledger = ledger
    run = ChunkRun(request, state, ledger, delivery)
    reply: CompileReply | None = None
    try:
        reply = given_up(ledger.returns, ledger.task_id, request) if ledger and \
            ledger.returns else None
        if reply is None:
            reply = run.run()
            if request.programs and not reply.dropped:
                reply = CompileReply(results=[*reply.results, *_programs(request, state,
                                                                          ledger)],
                                     dropped=reply.dropped)
    except (InfrastructureError, Avoided):
        if ledger is not None:
            ledger.given_back()
        raise
    finally:
        state.ledger = None
        _flush_records(state)  # a Loaded record goes with the chunk's end
        run.end(reply)
    return reply


def _programs(request: CompileRequest, state: WorkerState,
              ledger: TaskLedger | None) -> list[KernelReply]:
    """The chunk's programs (``worker.programs``), one after the other."""
    from worker.programs import obtain_program  # imports this module: not at the top

    results = []
    for p in request.programs:
        id_hash = p.spec.key.id_hash
        crashed = ledger.crashed(id_hash, len(request.kernels) + len(request.programs)) \
            if ledger else None
        if crashed is not None:
            log.error("program %s: %s", id_hash[:16], crashed)
            results.append(KernelReply(id_hash=id_hash, failure=KernelFailure(
                kind="crashed", message=crashed), host=state.host))
            continue
        if state.in_hand is not None and ledger is not None:
            state.in_hand.note(ledger.task_id, id_hash)
        results.append(obtain_program(p, state, request.requested_by))
    return results


def _flush_records(state: WorkerState) -> None:
    """Send the records now; on failure the recorder keeps them and retries later."""
    try:
        state.recorder.flush()
    except Exception as exc:  # Redis away: kept, sent with the next flush
        log.warning("records not sent yet (%s); kept for the next try", exc)


def obtain_kernel(req: KernelRequest, state: WorkerState,
                  requested_by: RequestedBy | None = None) -> KernelReply:
    """Obtain one kernel of a task on this worker (the rules of ``farm.compilation.obtain``);
    a kernel that cannot be obtained is a reply with its failure, never an exception,
    unless the farm failed, not the kernel (``InfrastructureError``: raised)."""
    start = time.perf_counter()
    key: Key | None = None
    try:
        key = store_key(state.registry, req.artifact, req.build_id)
        steps = WorkerSteps(req, key, state, requested_by, start)
        outcome = obtain(key, req.artifact.kernel.family, state.rules, steps)
    except KernelError as exc:
        failure = KernelFailure(kind=exc.kind, message=str(exc), build_log=exc.build_log)
        return _failed(req, key, failure, start)
    except InfrastructureError:  # not the kernel's failure: the chunk goes back
        raise
    except FarmError as exc:
        return _failed(req, key, KernelFailure(kind="validation", message=str(exc)), start)
    return KernelReply(id_hash=req.artifact.id_hash, key=str(key), outcome=outcome,
                       work_s=steps.work_s, worker=state.name, host=socket.gethostname())


class WorkerSteps:
    """One kernel's steps on a worker: lower and compile on its device, the compile
    lease in Redis, and records sent (waiting out a Redis outage) *before* the store
    is written, so a process killed in between leaves no artifact without its record."""

    def __init__(self, req: KernelRequest, key: Key, state: WorkerState,
                 requested_by: RequestedBy | None, start: float) -> None:
        self.req = req
        self.key = key
        self.state = state
        self.requested_by = requested_by
        self.start = start
        self.work_s = 0.0

    def lower(self) -> Lowered:
        family = self.state.registry.get(self.req.artifact.kernel.family)
        return family.lower_id(self.req.artifact, self.state.device)

    def compile(self, lowered: Lowered) -> Artifact:
        # Validated on this device before storing: a refused binary is never stored.
        state = self.state
        built = state.backend.finalize(lowered, state.settings.native_binaries,
                                       state.settings.pocl_ready)
        if not built.ok:
            error = LoadError if built.error_kind == "load" else CompileError
            raise error(built.error, build_log=built.build_log)
        return compiled_artifact(self.key, self.req.artifact.kernel.family, built,
                                 lowered.source_hash, worker=state.name)

    @contextlib.contextmanager
    def lease(self, source_hash: str) -> Iterator[bool]:
        state = self.state
        # the kernel and its lease noted for the crash ledger in the same round trip
        lease = state.leases.try_acquire(state.ns, source_hash,
                                         state.lease_note(self.req.artifact.id_hash))
        if lease is None:  # another worker compiles it: wait for it to let go
            state.leases.wait_released(state.ns, source_hash, LEASE_WAIT_S)
            yield False
            return
        with lease:
            yield True

    def record(self, outcome: Outcome, lowered: Lowered | None) -> None:
        state = self.state
        self.work_s = time.perf_counter() - self.start
        state.recorder.compilation(
            Trip(family=self.req.artifact.kernel.family, key=self.key, outcome=outcome,
                 work_s=self.work_s, worker=state.name, host=socket.gethostname(),
                 requested_by=self.requested_by, kernel=self.req.artifact.kernel.label()),
            lowered)
        if outcome is not Outcome.LOADED:
            send_records(state)


def send_records(state: WorkerState) -> None:
    """Send the records now, waiting out a Redis outage; OutageError past the limit."""
    if state.redis_waiter is None:
        state.recorder.flush()
        return
    state.redis_waiter.call(state.recorder.flush)


def _failed(req: KernelRequest, key: Key | None, failure: KernelFailure,
            start: float) -> KernelReply:
    return KernelReply(id_hash=req.artifact.id_hash, key=str(key) if key else None,
                       failure=failure, work_s=time.perf_counter() - start,
                       host=socket.gethostname())
