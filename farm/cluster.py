"""A build against the cluster: bulk look-up, misses sent to the fingerprint's queue.

The client expands the manifest and computes every key itself (with its own build ids),
asks the store which keys it holds in one bulk listing, and sends only the misses, in
chunks, to the queue of the target fingerprint. Workers do the rest (see
``worker.execute``); the client gathers their replies as they arrive.

Chunks: a task costs a few milliseconds of broker and result round trips, a compile
tens to hundreds of milliseconds, so a handful of kernels per task keeps the overhead
small while still spreading work over every worker process (``FARM_CHUNK_SIZE``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from farm.batch import BatchReport, KernelResult
from farm.device import DeviceInfo
from farm.errors import ClusterError, FarmError, UnsupportedFeature
from farm.families import Registry
from farm.keys import Namespace, queue_name
from farm.model import ArtifactId, KernelFailure, Key, Outcome
from farm.payloads import TASK_NAME, CompileReply, CompileRequest, KernelRequest
from farm.records import Recorder
from farm.records.model import RequestedBy
from farm.settings import Settings
from farm.store import ArtifactStore
from farm.workers import WorkerInfo, served

Progress = Callable[[KernelResult], None]


def check_served(client: Any, fingerprint: str) -> list[WorkerInfo]:
    """The live workers of ``fingerprint``, or a ClusterError naming those served."""
    workers = served(client)
    if fingerprint not in workers:
        known = ", ".join(sorted(workers)) or "none"
        raise ClusterError(f"no worker serves fingerprint {fingerprint}; fingerprints "
                           f"served: {known} (use --fallback-local to compile here)")
    return workers[fingerprint]


def cluster_build(settings: Settings, *, app: Any, registry: Registry, store: ArtifactStore,
                  fingerprint: str, artifacts: list[ArtifactId], recorder: Recorder | None,
                  label: str = "", progress: Progress | None = None, verify: bool = False,
                  device: DeviceInfo | None = None, timeout_s: float = 3600.0) -> BatchReport:
    """Obtain ``artifacts`` for ``fingerprint`` through the workers.

    ``device`` (the target's limits, published by its workers) lets the client count
    kernels that device cannot run as unsupported without sending them: they are never
    stored, so otherwise every build would send them again.
    """
    start = time.perf_counter()
    notify = progress or (lambda r: None)
    ns = Namespace.for_fingerprint(fingerprint)
    results = [KernelResult(artifact=a) for a in artifacts]
    requests: list[tuple[KernelResult, KernelRequest]] = []
    for res in results:
        try:
            family = registry.get(res.artifact.kernel.family)
        except FarmError as exc:
            res.failure = KernelFailure(kind="validation", message=str(exc))
            notify(res)
            continue
        res.key = Key(id_hash=res.artifact.id_hash, build_id=family.build_id)
        requests.append((res, KernelRequest(artifact=res.artifact, build_id=family.build_id)))

    held = store.existing(ns, [r.key for r, _ in requests if r.key])
    misses: list[tuple[KernelResult, KernelRequest]] = []
    for res, req in requests:
        t = time.perf_counter()
        if res.key in held and (not verify or store.get(ns, res.key) is not None):
            res.outcome = Outcome.LOADED
            res.work_s = time.perf_counter() - t
            notify(res)
        elif device is not None and _unsupported(res, registry, device):
            res.work_s = time.perf_counter() - t
            notify(res)
        else:
            misses.append((res, req))

    requested_by = None
    if recorder is not None:
        requested_by = RequestedBy(session=recorder.session.id, batch=recorder.reserve_seq())
    pending: dict[str, list[KernelResult]] = {}
    size = settings.chunk_size
    for i in range(0, len(misses), size):
        chunk = misses[i:i + size]
        payload = CompileRequest(fingerprint=fingerprint, kernels=[r for _, r in chunk],
                                 requested_by=requested_by)
        async_result = app.send_task(TASK_NAME, args=[payload.model_dump(mode="json")],
                                     queue=queue_name(fingerprint))
        pending[async_result.id] = [res for res, _ in chunk]
    tasks_sent = len(pending)

    # One MGET per interval for all pending results, not one round trip per task.
    try:
        for task_id, meta in app.backend.get_many(set(pending), timeout=timeout_s,
                                                  interval=0.05):
            _apply_reply(meta, pending.pop(task_id), notify)
            app.backend.forget(task_id)
    except TimeoutError:
        for chunk_results in pending.values():
            for res in chunk_results:
                res.failure = KernelFailure(kind="error", message="no reply from the "
                                            f"workers within {timeout_s:.0f} s")
                notify(res)

    wall = time.perf_counter() - start
    report = BatchReport(results=results, wall_s=wall,
                         parallelism=0, compiler_invocations=sum(
                             1 for r in results if r.outcome is Outcome.COMPILED))
    report.parallelism = len({r.worker for r in results if r.worker}) or 1
    report.tasks_sent = tasks_sent
    if recorder is not None:
        rec = recorder.batch(
            kernels=len(results), loaded=report.count(Outcome.LOADED),
            rekeyed=report.count(Outcome.REKEYED), compiled=report.count(Outcome.COMPILED),
            unsupported=len(report.unsupported), failed=len(report.failed),
            parallelism=report.parallelism, wall_s=wall, work_s=report.work_s, label=label,
            seq=requested_by.batch if requested_by else None)
        report.batch_seq = rec.stamp.seq if rec is not None else None
    return report


def _unsupported(res: KernelResult, registry: Registry, device: DeviceInfo) -> bool:
    """Lower for the target's limits; True (and the failure set) when it cannot run."""
    try:
        registry.get(res.artifact.kernel.family).lower_id(res.artifact, device)
    except UnsupportedFeature as exc:
        res.failure = KernelFailure(kind="unsupported", message=str(exc))
        return True
    except FarmError:
        return False  # the worker reports it, with its own device's view
    return False


def _apply_reply(meta: dict[str, Any], chunk: list[KernelResult], notify: Progress) -> None:
    if meta.get("status") != "SUCCESS":
        exc = meta.get("result") or {}
        what = (f"{exc.get('exc_type', 'error')}: {exc.get('exc_message', '')}"
                if isinstance(exc, dict) else str(exc))
        for res in chunk:
            res.failure = KernelFailure(kind="error",
                                        message=f"task failed on the worker: {what}")
            notify(res)
        return
    reply = CompileReply.model_validate(meta["result"])
    by_id = {r.id_hash: r for r in reply.results}
    for res in chunk:
        got = by_id.get(res.artifact.id_hash)
        if got is None:
            res.failure = KernelFailure(kind="error", message="missing from the worker's reply")
        else:
            res.outcome = got.outcome
            res.failure = got.failure
            res.work_s = got.work_s
            res.worker = got.worker
        notify(res)
