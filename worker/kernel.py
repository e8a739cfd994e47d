"""One kernel by the obtain rules, kernel by kernel: what does not fit a chunk's fast
path (:mod:`worker.chunkrun`): a kernel whose compile lease another worker holds (waited
for, then looked up), a second kernel of a source already in the chunk.

The rules are :func:`farm.compilation.obtain.obtain`'s (the same as an embedded batch's),
on the worker's side of :class:`~farm.compilation.obtain.Steps`: lower and compile on its
device, the compile lease in Redis, records sent *before* the store is written.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from farm.cluster.payloads import KernelReply, KernelRequest
from farm.compilation.obtain import obtain, store_key
from farm.core.errors import FarmError, InfrastructureError, KernelError
from farm.core.model import Artifact, KernelFailure, Key, Lowered
from farm.core.outcomes import Outcome
from farm.records.model import RequestedBy, Trip
from worker.state import LEASE_WAIT_S, WorkerState


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
        return _failed(req, key, failure, start, state.host)
    except InfrastructureError:  # not the kernel's failure: the chunk goes back
        raise
    except FarmError as exc:
        return _failed(req, key, KernelFailure(kind="validation", message=str(exc)), start,
                       state.host)
    return KernelReply(id_hash=req.artifact.id_hash, key=str(key), outcome=outcome,
                       work_s=steps.work_s, worker=state.name, host=state.host)


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
        return self.state.compile(self.key, self.req.artifact.kernel.family, lowered,
                                  lowered.source_hash)

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
                 work_s=self.work_s, worker=state.name, host=state.host,
                 requested_by=self.requested_by, kernel=self.req.artifact.kernel.label()),
            lowered)
        if outcome is not Outcome.LOADED:
            state.send_records()


def _failed(req: KernelRequest, key: Key | None, failure: KernelFailure,
            start: float, host: str) -> KernelReply:
    return KernelReply(id_hash=req.artifact.id_hash, key=str(key) if key else None,
                       failure=failure, work_s=time.perf_counter() - start,
                       host=host)
