"""``execute_job``: the one seam through which a worker obtains a chunk of kernels.

Per kernel, in order (the same outcomes as an embedded batch, see ``farm.compilation.batch``):

1. the family must be registered here and give the build id the client computed, else
   the kernel fails with a version-skew error naming both ids (client and worker run
   different kernel code; storing would put an artifact under a key its code did not
   produce);
2. the key is in the store -> **Loaded** (digest verified, loaded on this device);
3. lower; the source index knows the source -> **Rekeyed** (copy or move,
   ``farm.compilation.rekey``);
4. take the compile lease for the source: holding it, finalize, load, store ->
   **Compiled**; when another worker holds it, wait for it to go and look again, so a
   kernel in flight in two builds is compiled once.

A failing kernel is reported with its build log and nothing of it is stored.

Faults (docs/RELIABILITY.md): a kernel that killed its compiling process ``crash_limit``
times fails as ``crashed`` untouched (``worker.crashes``); Redis and MinIO outages are
waited out up to ``outage_limit`` (``farm.core.outage``), past it the kernel fails as
``store`` or ``error`` rather than as bad input; a compile's (or rekey's) record is sent
to the records stream *before* the store is written, so a process killed at any moment
never leaves an artifact whose record never came.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

from farm.cluster.payloads import CompileReply, CompileRequest, KernelReply, KernelRequest
from farm.compilation.finalize import finalize_and_validate
from farm.compilation.load import load
from farm.compilation.rekey import RekeyAction, rekey_action
from farm.core.errors import (
    ClusterError,
    CompileError,
    FarmError,
    KernelError,
    LoadError,
    StoreError,
    VersionSkewError,
)
from farm.core.model import Artifact, KernelFailure, Key, Lowered, Outcome
from farm.records.model import RequestedBy
from worker.crashes import TaskLedger, holder_name
from worker.state import WorkerState

log = logging.getLogger(__name__)

#: how long to wait for another worker's compile before taking over
LEASE_WAIT_S = 600.0


def execute_job(request: CompileRequest, state: WorkerState,
                task_id: str | None = None) -> CompileReply:
    """Obtain every kernel of ``request`` on this worker's device.

    ``task_id`` (the Celery task's) turns on crash-loop bookkeeping (``TaskLedger``)."""
    if request.fingerprint != state.device.fingerprint:
        raise FarmError(f"task for fingerprint {request.fingerprint} reached a worker of "
                        f"{state.device.fingerprint}")
    ledger = None
    if task_id is not None and state.redis is not None and state.redis_waiter is not None:
        ledger = TaskLedger(state.redis, task_id, state.redis_waiter,
                            state.settings.crash_limit)
        ledger.start(holder_name())
    state.ledger = ledger
    from worker.programs import obtain_program  # imports this module: not at the top

    results = []
    for k in request.kernels:
        crashed = ledger.crashed(k.artifact.id_hash, len(request.kernels)) \
            if ledger else None
        if crashed is not None:
            log.error("kernel %s: %s", k.artifact.kernel.label(), crashed)
            results.append(_failed(k, None, "crashed", crashed, "", time.perf_counter()))
            continue
        if ledger is not None:
            ledger.working_on(k.artifact.id_hash)
        results.append(_obtain(k, state, request.requested_by))
    for p in request.programs:
        id_hash = p.spec.key.id_hash
        crashed = ledger.crashed(id_hash, len(request.kernels) + len(request.programs)) \
            if ledger else None
        if crashed is not None:
            log.error("program %s: %s", id_hash[:16], crashed)
            results.append(KernelReply(id_hash=id_hash, failure=KernelFailure(
                kind="crashed", message=crashed), host=socket.gethostname()))
            continue
        if ledger is not None:
            ledger.working_on(id_hash)
        results.append(obtain_program(p, state, request.requested_by))
    if ledger is not None:
        ledger.working_on(None)
    state.ledger = None
    _flush_records(state)
    return CompileReply(results=results)


def _flush_records(state: WorkerState) -> None:
    """Send the records now; on failure the recorder keeps them and retries later."""
    try:
        state.recorder.flush()
    except Exception as exc:  # Redis away: kept, sent with the next flush
        log.warning("records not sent yet (%s); kept for the next try", exc)


def _obtain(req: KernelRequest, state: WorkerState,
            requested_by: RequestedBy | None) -> KernelReply:
    start = time.perf_counter()
    family_name = req.artifact.kernel.family
    key: Key | None = None
    work = 0.0

    def record(outcome: Outcome, lowered: Lowered | None) -> None:
        """Record the kernel; one that changes the store is recorded, and its record
        sent (waiting out a Redis outage), *before* the store is written: a process
        killed in between leaves no artifact without its record."""
        nonlocal work
        work = time.perf_counter() - start
        state.recorder.compilation(
            family=family_name, key=key or "", outcome=outcome, work_s=work,
            source=lowered.source if lowered else None,
            options=list(lowered.options) if lowered else None, worker=state.name,
            host=socket.gethostname(), requested_by=requested_by)
        if outcome is not Outcome.LOADED:
            send_records(state)

    try:
        family = state.registry.get(family_name)
        if family.build_id != req.build_id:
            raise VersionSkewError(
                f"version skew for family {family_name}: client build id {req.build_id}, "
                f"worker build id {family.build_id} (client and worker run different "
                "kernel code)")
        key = Key(id_hash=req.artifact.id_hash, build_id=req.build_id)
        outcome = _resolve(req, key, state, record)
    except KernelError as exc:
        return _failed(req, key, exc.kind, str(exc), exc.build_log, start)
    except StoreError as exc:
        return _failed(req, key, "store", str(exc), "", start)
    except ClusterError as exc:  # Redis unreachable past the outage limit
        return _failed(req, key, "error", str(exc), "", start)
    except FarmError as exc:
        return _failed(req, key, "validation", str(exc), "", start)
    if outcome is Outcome.LOADED:
        record(outcome, None)
    return KernelReply(id_hash=req.artifact.id_hash, key=str(key), outcome=outcome,
                       work_s=work, worker=state.name, host=socket.gethostname())


def send_records(state: WorkerState) -> None:
    """Send the records now, waiting out a Redis outage; OutageError past the limit."""
    if state.redis_waiter is None:
        state.recorder.flush()
        return
    state.redis_waiter.call(state.recorder.flush)


Record = Callable[[Outcome, "Lowered | None"], None]


def _resolve(req: KernelRequest, key: Key, state: WorkerState, record: Record) -> Outcome:
    if _load_stored(key, state):
        return Outcome.LOADED
    family = state.registry.get(req.artifact.kernel.family)
    lowered = family.lower_id(req.artifact, state.device)
    source_hash = lowered.source_hash
    while True:
        if _rekey(key, req.artifact.kernel.family, lowered, state, record):
            return Outcome.REKEYED
        lease = state.leases.try_acquire(state.ns, source_hash)
        if lease is None:
            state.leases.wait_released(state.ns, source_hash, LEASE_WAIT_S)
            if _load_stored(key, state):  # the other worker compiled this very key
                return Outcome.LOADED
            continue  # stored under another key (rekey above), or it failed: try again
        with lease:
            if state.ledger is not None:
                state.ledger.holding(lease.name, lease.token)
            try:
                if _load_stored(key, state):
                    return Outcome.LOADED
                if _rekey(key, req.artifact.kernel.family, lowered, state, record):
                    return Outcome.REKEYED
                _compile(req, key, lowered, state, record)
                return Outcome.COMPILED
            finally:
                if state.ledger is not None:
                    state.ledger.holding(None)


def _loadable(key: Key, state: WorkerState) -> Artifact | None:
    """The stored artifact of ``key`` if it verifies and this device loads it."""
    art = state.store.get(state.ns, key)
    if art is None:
        return None
    try:
        load(state.ctx, state.cl_device, art.binary, arch=state.device.native_arch)
    except LoadError:
        return None
    return art


def _load_stored(key: Key, state: WorkerState) -> bool:
    return _loadable(key, state) is not None


def _rekey(key: Key, family: str, lowered: Lowered, state: WorkerState,
           record: Record) -> bool:
    source_hash = lowered.source_hash
    found = state.store.find_source(state.ns, source_hash)
    if found is None or found == key:
        return False
    art = _loadable(found, state)
    if art is None or art.meta.source_hash != source_hash:  # index entries are hints
        return False
    action = rekey_action(found, art.meta.family, key, family)
    record(Outcome.REKEYED, lowered)
    state.store.rekey(state.ns, found, key, move=action is RekeyAction.MOVE, source=lowered)
    return True


def _compile(req: KernelRequest, key: Key, lowered: Lowered, state: WorkerState,
             record: Record) -> None:
    # Validated on this device before storing: a refused binary is never stored.
    built = finalize_and_validate(state.ctx, state.cl_device, lowered,
                                  "auto" if state.settings.native_binaries else None)
    if not built.ok:
        error = LoadError if built.error_kind == "load" else CompileError
        raise error(built.error, build_log=built.build_log)
    art = Artifact.create(key, req.artifact.kernel.family, built.binary, lowered.source_hash,
                          build_log=built.build_log, host=built.host, worker=state.name,
                          work_s=built.work_s)
    record(Outcome.COMPILED, lowered)
    state.store.put(state.ns, art, source=lowered)


def _failed(req: KernelRequest, key: Key | None, kind: str, message: str, build_log: str,
            start: float) -> KernelReply:
    return KernelReply(id_hash=req.artifact.id_hash, key=str(key) if key else None,
                       failure=KernelFailure(kind=kind, message=message,
                                             build_log=build_log),
                       work_s=time.perf_counter() - start, host=socket.gethostname())
