"""``execute_job``: the one seam through which a worker obtains a chunk of kernels.

Per kernel, in order (the same outcomes as an embedded batch, see ``farm.batch``):

1. the family must be registered here and give the build id the client computed, else
   the kernel fails with a version-skew error naming both ids (client and worker run
   different kernel code; storing would put an artifact under a key its code did not
   produce);
2. the key is in the store -> **Loaded** (digest verified, loaded on this device);
3. lower; the source index knows the source -> **Rekeyed** (copy or move, ``farm.rekey``);
4. take the compile lease for the source: holding it, finalize, load, store ->
   **Compiled**; when another worker holds it, wait for it to go and look again, so a
   kernel in flight in two builds is compiled once.

A failing kernel is reported with its build log and nothing of it is stored.
"""

from __future__ import annotations

import socket
import time

from farm.errors import CompileError, FarmError, KernelError, LoadError, VersionSkewError
from farm.finalize import finalize_and_validate
from farm.load import load
from farm.model import Artifact, KernelFailure, Key, Lowered, Outcome
from farm.payloads import CompileReply, CompileRequest, KernelReply, KernelRequest
from farm.records.model import RequestedBy
from farm.rekey import RekeyAction, rekey_action
from worker.state import WorkerState

#: how long to wait for another worker's compile before taking over
LEASE_WAIT_S = 600.0


def execute_job(request: CompileRequest, state: WorkerState) -> CompileReply:
    """Obtain every kernel of ``request`` on this worker's device."""
    if request.fingerprint != state.device.fingerprint:
        raise FarmError(f"task for fingerprint {request.fingerprint} reached a worker of "
                        f"{state.device.fingerprint}")
    return CompileReply(results=[_obtain(k, state, request.requested_by)
                                 for k in request.kernels])


def _obtain(req: KernelRequest, state: WorkerState,
            requested_by: RequestedBy | None) -> KernelReply:
    start = time.perf_counter()
    family_name = req.artifact.kernel.family
    key: Key | None = None
    try:
        family = state.registry.get(family_name)
        if family.build_id != req.build_id:
            raise VersionSkewError(
                f"version skew for family {family_name}: client build id {req.build_id}, "
                f"worker build id {family.build_id} (client and worker run different "
                "kernel code)")
        key = Key(id_hash=req.artifact.id_hash, build_id=req.build_id)
        outcome, lowered = _resolve(req, key, state)
    except KernelError as exc:
        return _failed(req, key, exc.kind, str(exc), exc.build_log, start)
    except FarmError as exc:
        return _failed(req, key, "validation", str(exc), "", start)
    work = time.perf_counter() - start
    state.recorder.compilation(
        family=family_name, key=key, outcome=outcome, work_s=work,
        source=lowered.source if lowered else None,
        options=list(lowered.options) if lowered else None, worker=state.name,
        host=socket.gethostname(), requested_by=requested_by)
    return KernelReply(id_hash=req.artifact.id_hash, key=str(key), outcome=outcome,
                       work_s=work, worker=state.name, host=socket.gethostname())


def _resolve(req: KernelRequest, key: Key, state: WorkerState) -> tuple[Outcome, Lowered | None]:
    if _load_stored(key, state):
        return Outcome.LOADED, None
    family = state.registry.get(req.artifact.kernel.family)
    lowered = family.lower_id(req.artifact, state.device)
    source_hash = lowered.source_hash
    while True:
        if _rekey(key, req.artifact.kernel.family, lowered, state):
            return Outcome.REKEYED, lowered
        lease = state.leases.try_acquire(state.ns, source_hash)
        if lease is None:
            state.leases.wait_released(state.ns, source_hash, LEASE_WAIT_S)
            if _load_stored(key, state):  # the other worker compiled this very key
                return Outcome.LOADED, None
            continue  # stored under another key (rekey above), or it failed: try again
        with lease:
            if _load_stored(key, state):
                return Outcome.LOADED, None
            if _rekey(key, req.artifact.kernel.family, lowered, state):
                return Outcome.REKEYED, lowered
            _compile(req, key, lowered, state)
            return Outcome.COMPILED, lowered


def _loadable(key: Key, state: WorkerState) -> Artifact | None:
    """The stored artifact of ``key`` if it verifies and this device loads it."""
    art = state.store.get(state.ns, key)
    if art is None:
        return None
    try:
        load(state.ctx, state.cl_device, art.binary)
    except LoadError:
        return None
    return art


def _load_stored(key: Key, state: WorkerState) -> bool:
    return _loadable(key, state) is not None


def _rekey(key: Key, family: str, lowered: Lowered, state: WorkerState) -> bool:
    found = state.store.find_source(state.ns, lowered.source_hash)
    if found is None or found == key:
        return False
    art = _loadable(found, state)
    if art is None:
        return False
    action = rekey_action(found, art.meta.family, key, family)
    state.store.rekey(state.ns, found, key, move=action is RekeyAction.MOVE, source=lowered)
    return True


def _compile(req: KernelRequest, key: Key, lowered: Lowered, state: WorkerState) -> None:
    # Validated on this device before storing: a refused binary is never stored.
    built = finalize_and_validate(state.ctx, state.cl_device, lowered)
    if not built.ok:
        error = LoadError if built.error_kind == "load" else CompileError
        raise error(built.error, build_log=built.build_log)
    art = Artifact.create(key, req.artifact.kernel.family, built.binary, lowered.source_hash,
                          build_log=built.build_log, host=built.host, worker=state.name,
                          work_s=built.work_s)
    state.store.put(state.ns, art, source=lowered)


def _failed(req: KernelRequest, key: Key | None, kind: str, message: str, build_log: str,
            start: float) -> KernelReply:
    return KernelReply(id_hash=req.artifact.id_hash, key=str(key) if key else None,
                       failure=KernelFailure(kind=kind, message=message,
                                             build_log=build_log),
                       work_s=time.perf_counter() - start, host=socket.gethostname())
