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
source) goes kernel by kernel (:mod:`worker.kernel`); a chunk's programs after its
kernels (:mod:`worker.programs`).

A failing kernel is reported with its build log and nothing of it is stored.

Faults (docs/RELIABILITY.md): a kernel that killed its compiling process ``crash_limit``
times fails as ``crashed`` untouched (``worker.crashes``); Redis and MinIO outages are
waited out up to ``outage_limit`` (``farm.core.outage``). Only a kernel's own failure
(``KernelError``, bad input about it) fails it: an ``InfrastructureError`` (the store,
Redis past the limit, this worker's own state) leaves ``execute_job``, and the task gives
the whole chunk back to its queue for another worker (``worker.app``); its hooks note the
return, and that delivery does not count towards the crash limit (``worker.hooks``). A
compile's (or rekey's) record is sent to the records stream *before* the store is
written, so a process killed at any moment never leaves an artifact whose record never
came.
"""

from __future__ import annotations

import logging

from farm.cluster.payloads import CompileReply
from farm.core.errors import WorkerUnavailable
from farm.programs.request import ChunkRequest
from worker.chunkrun import ChunkRun
from worker.chunks import Delivery, given_up
from worker.programs import obtain_programs
from worker.state import WorkerState

log = logging.getLogger(__name__)

def execute_job(request: ChunkRequest, state: WorkerState, *,
                delivery: Delivery | None = None) -> CompileReply:
    """Obtain every kernel of ``request`` on this worker's device.

    ``delivery`` (the Celery task's) turns on the check that the chunk's client is
    alive, the reply onto the build's reply stream (``delivery.pushed`` says whether it
    got there) and, with its ``ledger`` (the crash hook's), the crash-loop bookkeeping.
    Raises :class:`InfrastructureError` when the chunk cannot be built here for reasons
    that are not its kernels' (see the module docstring), ``Avoided`` when its client
    sends this worker no more of its build."""
    if request.fingerprint != state.fingerprint:
        raise WorkerUnavailable(f"task for fingerprint {request.fingerprint} reached a "
                                f"worker of {state.fingerprint}")
    ledger = delivery.ledger if delivery is not None else None
    state.ledger = ledger
    run = ChunkRun(request, state, ledger, delivery)
    reply: CompileReply | None = None
    try:
        reply = given_up(ledger.returns, ledger.task_id, request) if ledger and \
            ledger.returns else None
        if reply is None:
            reply = run.run()
            if request.programs and not reply.dropped:
                reply = CompileReply(results=[*reply.results,
                                              *obtain_programs(request, state, ledger)],
                                     dropped=reply.dropped)
    finally:
        state.ledger = None
        state.flush_records()  # a Loaded record goes with the chunk's end
        run.end(reply)
    return reply
