"""Tuning on the pool of a fingerprint: one task per key, measured on a worker's device.

The client sends every key at once to the fingerprint's queue (``farm.tune`` tasks,
:class:`~farm.tuning.payloads.TuneRequest`) and gathers the replies as they come
(Celery's result channel, as for compile chunks). Each worker process takes one task
at a time (``worker_prefetch_multiplier=1``): it builds what the key lacks, then
measures every candidate of the key on its own device, in its own process, inside the
host's isolation (``farm.core.isolation``: the other pool processes of that host do
not compile meanwhile, and measurements of one device take turns), stores the result
and records it. So keys spread over hosts and devices, and the candidates of one key
never do.

A task whose pool process dies goes back to the queue (late acknowledgement); a key
whose measuring process died ``FARM_CRASH_LIMIT`` times fails instead of looping
(``worker.tune``). A worker whose main process dies gives its task back after the
broker's visibility timeout: tuning is idempotent (a key already stored is reused), so
a second delivery costs only time.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import ValidationError

from farm.cluster.client import ClusterClient
from farm.core.errors import one_line
from farm.core.keys import TUNE_TASK_NAME, queue_name
from farm.records.model import RequestedBy
from farm.tuning.keys import TuningSpec
from farm.tuning.model import MeasurePolicy
from farm.tuning.payloads import TuneReply, TuneRequest
from farm.tuning.runner import TuneOutcome

if TYPE_CHECKING:
    from celery.result import AsyncResult

#: seconds one wait for replies lasts (between two looks at the clock and at Redis)
WAIT_S = 1.0


def tune_on_cluster(client: ClusterClient, specs: list[TuningSpec], fingerprint: str, *,
                    policy: MeasurePolicy, retune: bool = False,
                    requested_by: RequestedBy | None = None,
                    notify: Callable[[TuneOutcome], None] | None = None,
                    timeout_s: float = 3600.0) -> list[TuneOutcome]:
    """Every key of ``specs`` tuned by the workers of ``fingerprint``, in order."""
    tell = notify or (lambda outcome: None)
    outcomes: dict[str, TuneOutcome] = {}
    pending: dict[str, tuple[TuningSpec, AsyncResult]] = {}
    for spec in specs:
        payload = TuneRequest(fingerprint=fingerprint, spec=spec, policy=policy,
                              retune=retune, requested_by=requested_by)
        task_id = str(uuid.uuid4())

        def send(body: TuneRequest = payload, tid: str = task_id) -> AsyncResult:
            return client.app.send_task(TUNE_TASK_NAME, args=[body.model_dump(mode="json")],
                                        queue=queue_name(fingerprint), task_id=tid)

        pending[task_id] = (spec, client.waiter.call(send))
    deadline = time.monotonic() + timeout_s
    try:
        while pending:
            if time.monotonic() > deadline:
                for task_id, (spec, _) in pending.items():
                    outcomes[task_id] = TuneOutcome(spec=spec, failure=(
                        f"no reply from the workers within {timeout_s:.0f} s"))
                    tell(outcomes[task_id])
                break
            for task_id, meta in client.waiter.call(lambda: _replies(client, pending)):
                spec, _ = pending.pop(task_id)
                outcomes[task_id] = _outcome(spec, meta)
                tell(outcomes[task_id])
                _forget(client, task_id)
    finally:
        for _, result in pending.values():
            result.backend = None  # a frozen Redis must not hold the exit up
    by_spec = {id(o.spec): o for o in outcomes.values()}
    return [by_spec[id(spec)] for spec in specs]


def _replies(client: ClusterClient, pending: dict[str, tuple[TuningSpec, AsyncResult]]
             ) -> list[tuple[str, dict[str, object]]]:
    """The replies that arrive within one wait."""
    from celery.exceptions import TimeoutError as WaitOver
    from celery.result import ResultSet

    got: list[tuple[str, dict[str, object]]] = []
    waiting = ResultSet([r for _, r in pending.values()], app=client.app)
    try:
        for task_id, meta in client.app.backend.iter_native(waiting, timeout=WAIT_S,
                                                            interval=0):
            got.append((task_id, meta))
    except WaitOver:
        pass
    return [(t, m) for t, m in got if t in pending]


def _outcome(spec: TuningSpec, meta: dict[str, object]) -> TuneOutcome:
    if meta.get("status") != "SUCCESS":
        error = meta.get("result")
        what = (f"{type(error).__name__}: {error}" if isinstance(error, BaseException)
                else str(error or meta.get("status")))
        return TuneOutcome(spec=spec, failure=f"the tuning task failed: {what}"[:1000])
    try:
        reply = TuneReply.model_validate(meta.get("result"))
    except ValidationError as exc:
        return TuneOutcome(spec=spec, failure=f"unreadable reply: {one_line(exc)[:300]}")
    if reply.result is not None and reply.result.spec != spec:
        return TuneOutcome(spec=spec, failure="the reply is about another key")
    return TuneOutcome(spec=spec, result=reply.result, reused=reply.reused,
                       failure=reply.failure if reply.result is None else "")


def _forget(client: ClusterClient, task_id: str) -> None:
    """Delete a reply once read (best effort: results expire by themselves)."""
    backend = client.app.backend
    try:
        client.redis.delete(backend.get_key_for_task(task_id))
    except Exception:  # Redis away now: the result expires
        pass
