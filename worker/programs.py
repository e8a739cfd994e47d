"""Obtaining an application's program on a worker (``farm.programs``), one request.

The rules of ``farm.compilation.obtain`` (its :class:`~farm.compilation.obtain.Obtainer`:
the Loaded rule, and keep after a validated compile, first writer wins), minus the
rekey: a program's key *is* its source, options and headers, and the source index (a
hash of source and options only) would hand it a binary made with other headers.

1. the key, computed here from the spec (never taken from the client), is in the store
   and its body is proven on this node (``farm.programs.proving``: the program and device
   it names, its structure, and a load in a child process with a private driver cache,
   the node's book first) -> **Loaded**; one refused is quarantined, and compiled again;
2. take the compile lease for the key; holding it, read the source and headers from the
   store by digest, check they resolve as the spec says, compile them laid out in a
   private folder (``farm.programs.compile``), validate by a load, record, store ->
   **Compiled**; when another worker holds the lease, wait for it and look again.

A source the compiler refuses fails as ``compile`` with its build log; a blob missing
from the store as ``store``; a spec whose headers do not resolve as it says as
``validation``. Nothing of a failure is stored.

Then, on PoCL's CPU drivers, the work-group functions of the launches a capture recorded
for the program (``ProgramRequest.launches``) that its records lack are made, in an
isolated child of this worker process, and stored beside it
(:func:`farm.programs.making.make_ready`). What could not be made is logged, and the
program's outcome stands: its first launches on a node then compile, as before.
"""

from __future__ import annotations

import atexit
import logging
import time
from typing import TYPE_CHECKING

from farm.cluster.payloads import KernelReply
from farm.compilation.obtain import Obtainer
from farm.core.errors import (
    CompileError,
    FarmError,
    InfrastructureError,
    KernelError,
    LoadError,
    printable,
)
from farm.core.keys import PROGRAM_FAMILY
from farm.core.model import KernelFailure, Key, Lowered
from farm.core.outcomes import Outcome
from farm.programs.compile import compile_laid_out
from farm.programs.making import Makers, make_ready
from farm.programs.proving import Proving, compiled_here
from farm.programs.request import ChunkRequest, ProgramRequest
from farm.programs.spec import ProgramSpec
from farm.records.model import RequestedBy, Trip
from farm.store.base import set_aside
from worker.state import LEASE_WAIT_S, WorkerState

if TYPE_CHECKING:
    from worker.crashes import TaskLedger

log = logging.getLogger(__name__)


def obtain_programs(request: ChunkRequest, state: WorkerState,
                    ledger: TaskLedger | None) -> list[KernelReply]:
    """The chunk's programs, one after the other; a program that killed its compiling
    process ``crash_limit`` times fails as ``crashed`` untouched (``worker.crashes``)."""
    results = []
    for p in request.programs:
        key = p.spec.key  # a hash of the spec: computed once
        id_hash = key.id_hash
        crashed = ledger.crashed(id_hash, len(request.kernels) + len(request.programs)) \
            if ledger else None
        if crashed is not None:
            log.error("program %s: %s", id_hash[:16], crashed)
            results.append(KernelReply(id_hash=id_hash, failure=KernelFailure(
                kind="crashed", message=crashed), host=state.host))
            continue
        if state.in_hand is not None and ledger is not None:
            state.in_hand.note(ledger.task_id, id_hash)
        results.append(obtain_program(p, key, state, request.requested_by))
    return results


def obtain_program(req: ProgramRequest, key: Key, state: WorkerState,
                   requested_by: RequestedBy | None) -> KernelReply:
    """One program of a chunk (``key``: its spec's), as a reply (failures are values);
    then the work-group functions its capture's launches need (PoCL)."""
    start = time.perf_counter()
    spec = req.spec
    try:
        outcome = _resolve(spec, key, state, requested_by, start)
    except KernelError as exc:
        return _failed(key, KernelFailure(kind=exc.kind, message=str(exc),
                                          build_log=exc.build_log), start, state.host)
    except InfrastructureError:  # not the program's failure: the chunk goes back
        raise
    except FarmError as exc:
        return _failed(key, KernelFailure(kind="error", message=str(exc)), start, state.host)
    if req.launches:
        _make_ready(req, state)
    work = time.perf_counter() - start
    if outcome is Outcome.LOADED:
        state.recorder.compilation(Trip(family=PROGRAM_FAMILY, key=key, outcome=outcome,
                                        work_s=work, worker=state.name,
                                        host=state.host, requested_by=requested_by))
    return KernelReply(id_hash=key.id_hash, key=str(key), outcome=outcome, work_s=work,
                       worker=state.name, host=state.host)


#: this worker process's work-group function makers, per device fingerprint
_MAKERS: dict[str, Makers] = {}


def _make_ready(req: ProgramRequest, state: WorkerState) -> None:
    """Make the functions of ``req``'s launches its program's records lack (PoCL)."""
    if not (state.device.compiles_at_launch and state.settings.pocl_ready):
        return
    fp = state.device.fingerprint
    makers = _MAKERS.get(fp)
    if makers is None:
        makers = _MAKERS[fp] = Makers(state.device)
        atexit.register(makers.close)  # its children's private caches go with them
    done = make_ready(state.store, state.device, req.spec.key,
                      frozenset(x.pair for x in req.launches), makers)
    for key, why in done.failed:  # the driver's words: escaped, as every echoed text
        log.warning("program %s: %s", key[:16], printable(why))
    if done.made:
        log.info("program %s: %d work-group function(s) made and stored",
                 req.spec.key.id_hash[:16], done.made)


def _loads(key: Key, state: WorkerState) -> bool:
    """Whether the store holds ``key``'s program, proven on this node (a refused one is
    quarantined: the key is then free for the compile that repairs it)."""
    art = state.store.get(state.ns, key)
    if art is None:
        return False
    proven = _proving(state).program(state.device, key, art)
    if proven.body is None and proven.definite:
        set_aside(state.store, state.ns, art, proven.why)
    return proven.body is not None


def _proving(state: WorkerState) -> Proving:
    """The program proofs of this worker process: the node's book and the one child the
    families' proofs use too."""
    return Proving.around(state.prover)


def _resolve(spec: ProgramSpec, key: Key, state: WorkerState,
             requested_by: RequestedBy | None, start: float) -> Outcome:
    while True:
        if _loads(key, state):
            return Outcome.LOADED
        # the program and its lease noted for the crash ledger in the same round trip
        lease = state.leases.try_acquire(state.ns, key.id_hash, state.lease_note(key.id_hash))
        if lease is None:
            state.leases.wait_released(state.ns, key.id_hash, LEASE_WAIT_S)
            continue
        with lease:
            if _loads(key, state):
                return Outcome.LOADED
            _compile(spec, key, state, requested_by, start)
            return Outcome.COMPILED


def _compile(spec: ProgramSpec, key: Key, state: WorkerState,
             requested_by: RequestedBy | None, start: float) -> None:
    blobs: dict[str, bytes] = {}
    for digest in spec.digests():
        data = state.store.get_blob(digest)
        if data is not None:
            blobs[digest] = data
    built = compile_laid_out(state.ctx, state.cl_device, spec, blobs,
                             state.settings.native_binaries, state.settings.pocl_ready)
    if not built.ok:
        if built.error_kind == "validation":
            kind = "store" if "not in the store" in built.error else "validation"
            raise _Refused(kind, built.error)
        error = LoadError if built.error_kind == "load" else CompileError
        raise error(built.error, build_log=built.build_log)
    got = compiled_here(state.device, key, spec.blob_digest,
                        built.model_copy(update={"worker": state.name}))
    if not got.storable:
        raise LoadError("the compiled binary is not one the farm can store (its layout "
                        "does not walk, or its kernel names do not fit a program body)")
    art = got.art
    # recorded (and sent) before the store is written, as for kernels (worker.execute)
    state.recorder.compilation(
        Trip(family=PROGRAM_FAMILY, key=key, outcome=Outcome.COMPILED,
             work_s=time.perf_counter() - start, worker=state.name,
             host=state.host, requested_by=requested_by),
        Lowered(source=blobs[spec.source].decode("utf-8", "replace"), options=spec.options,
                kernel_names=()))
    state.send_records()
    state.store.put_blob(spec.to_blob())  # the artifact names its spec (source_hash)
    Obtainer(state.store, state.ns).keep(key, PROGRAM_FAMILY, art, None)  # no rekey


class _Refused(KernelError):
    """Inputs that cannot be compiled as the spec says (missing or mismatched blobs)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _failed(key: Key, failure: KernelFailure, start: float, host: str) -> KernelReply:
    return KernelReply(id_hash=key.id_hash, key=str(key), failure=failure,
                       work_s=time.perf_counter() - start, host=host)
