"""Building a capture ahead of time: ``farm build CAPTURE [--cluster] [--fingerprint FP]``.

For each target fingerprint (every one the capture names, or ``--fingerprint``), the
programs whose key the store lacks are compiled: here, on a pool of this machine's
compile processes when the local device has that fingerprint; or on the cluster's pool
of that fingerprint, each chunk a task that carries specs (digests), the sources and
headers put into the store's blobs first. Outcomes and reports are a batch's
(:class:`~farm.compilation.batch.BatchReport`), one per fingerprint, so ``farm build``
prints them as it prints a manifest's; each program appears as ``program(key=...)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, as_completed
from typing import TYPE_CHECKING, Any

from farm.compilation.batch import BatchReport, KernelResult
from farm.compilation.compiler import ProcessPoolCompiler
from farm.compilation.finalize import FinalizeResult
from farm.core.device import DeviceInfo
from farm.core.keys import PROGRAM_FAMILY, Namespace
from farm.core.model import ArtifactId, KernelFailure, KernelId
from farm.core.outcomes import Fate, Outcome
from farm.core.settings import Settings
from farm.programs.capture import CaptureFile
from farm.programs.compile import ProgramJob, pool_compile
from farm.programs.proving import compiled_here
from farm.programs.spec import ProgramSpec
from farm.records import Recorder
from farm.records.model import Trip
from farm.store.base import ArtifactStore

if TYPE_CHECKING:
    from farm.cluster.client import ClusterClient

Progress = Callable[[KernelResult], None]


def handle(spec: ProgramSpec) -> ArtifactId:
    """How a program appears in a batch's report (its label, ``program(key=...)``): a
    name for people and summaries, never a family the registry knows."""
    return ArtifactId(kernel=KernelId(family=PROGRAM_FAMILY,
                                      params={"key": spec.key.id_hash[:16]}))


def targets(capture: CaptureFile, fingerprint: str | None) -> dict[str, list[ProgramSpec]]:
    """Fingerprint -> the programs to build for it, each key once (a capture may list the
    same program many times: it is built once)."""
    out: dict[str, dict[str, ProgramSpec]] = {}
    for p in capture.programs:
        for fp in [fingerprint] if fingerprint else p.fingerprints:
            out.setdefault(fp, {}).setdefault(p.spec.key.id_hash, p.spec)
    return {fp: list(specs.values()) for fp, specs in out.items()}


def put_blobs(store: ArtifactStore, capture: CaptureFile, specs: list[ProgramSpec]) -> int:
    """Put every source and header of ``specs`` the store lacks; returns how many."""
    wanted = {d: None for s in specs for d in s.digests()}
    specs_by_digest = {s.blob_digest: s for s in specs}  # its artifact names it
    held = store.existing_blobs([*wanted, *specs_by_digest])
    missing = [d for d in [*wanted, *specs_by_digest] if d not in held]
    for digest in missing:
        spec = specs_by_digest.get(digest)
        store.put_blob(spec.to_blob() if spec is not None else capture.blob(digest))
    return len(missing)


def _results(store: ArtifactStore, ns: Namespace, specs: list[ProgramSpec],
             notify: Progress) -> tuple[list[KernelResult], list[tuple[KernelResult,
                                                                        ProgramSpec]]]:
    """Every program's result, and the misses (the store lacks their key)."""
    results = [KernelResult(artifact=handle(s), key=s.key) for s in specs]
    held = store.existing(ns, [s.key for s in specs])
    misses = []
    for res, spec in zip(results, specs, strict=True):
        if spec.key in held:
            res.outcome = Outcome.LOADED
            notify(res)
        elif not spec.portable:
            res.failure = KernelFailure(kind=Fate.UNSUPPORTED, message=(
                "its headers lie outside its folders: compiled only where the application "
                "runs"))
            notify(res)
        else:
            misses.append((res, spec))
    return results, misses


def build_here(settings: Settings, device: DeviceInfo, capture: CaptureFile, *,
               store: ArtifactStore, recorder: Recorder, workers: int,
               progress: Progress | None = None) -> BatchReport:
    """Compile the capture's programs for ``device`` on this machine's compile pool."""
    start = time.perf_counter()
    notify = progress or (lambda r: None)
    specs = targets(capture, device.fingerprint).get(device.fingerprint, [])
    ns = Namespace.for_fingerprint(device.fingerprint)
    results, misses = _results(store, ns, specs, notify)
    if misses:
        put_blobs(store, capture, [s for _, s in misses])
        pool = ProcessPoolCompiler(device, max(1, workers), settings.native_binaries,
                                   crash_limit=settings.crash_limit)
        stopped = False
        try:
            futures: dict[Future[FinalizeResult], tuple[KernelResult, ProgramSpec]] = {}
            for res, spec in misses:
                job = ProgramJob(spec=spec, blobs={d: capture.blob(d) for d in spec.digests()},
                                 ready=settings.pocl_ready)
                futures[pool.submit_job(pool_compile, job.model_dump_json())] = res, spec
            for fut in as_completed(futures):
                res, spec = futures[fut]
                _finish(store, device, res, spec, fut.result(), recorder)
                notify(res)
        except BaseException:  # interrupted (SIGINT, or SIGTERM made one): stop them now
            stopped = True
            pool.close(now=True)
            raise
        finally:
            if not stopped:
                pool.close()
    return BatchReport(results=results, wall_s=time.perf_counter() - start,
                       parallelism=max(1, workers), compiler_invocations=len(misses))


def _finish(store: ArtifactStore, device: DeviceInfo, res: KernelResult, spec: ProgramSpec,
            built: FinalizeResult, recorder: Recorder) -> None:
    res.add_part("compile", built.work_s)
    res.worker = built.worker
    if not built.ok:
        kind: Any = built.error_kind if built.error_kind in (
            "compile", "load", "crashed", "validation") else "error"
        res.failure = KernelFailure(kind=kind, message=built.error, build_log=built.build_log)
        return
    got = compiled_here(device, spec.key, spec.blob_digest, built)
    if not got.storable:
        res.failure = KernelFailure(kind="load", message=(
            "the compiled binary is not one the farm can store (its layout does not walk, "
            "or its kernel names do not fit a program body)"))
        return
    store.put(Namespace.for_fingerprint(device.fingerprint), got.art)
    res.outcome = Outcome.COMPILED
    recorder.compilation(Trip(family=PROGRAM_FAMILY, key=spec.key, outcome=Outcome.COMPILED,
                              work_s=built.work_s, worker=built.worker))


def build_on_cluster(client: ClusterClient, capture: CaptureFile, fingerprint: str, *,
                     progress: Progress | None = None,
                     status: Callable[[str], None] | None = None) -> BatchReport:
    """Send the programs ``client.store`` lacks for ``fingerprint`` to its workers (whose
    liveness the caller checked: ``client.served``)."""
    from farm.programs.request import ChunkRequest, ProgramRequest

    start = time.perf_counter()
    notify = progress or (lambda r: None)
    specs = targets(capture, fingerprint).get(fingerprint, [])
    ns = Namespace.for_fingerprint(fingerprint)
    results, misses = _results(client.store, ns, specs, notify)
    if misses:
        put_blobs(client.store, capture, [s for _, s in misses])
    size = client.settings.chunk_size
    chunks = [(ChunkRequest(fingerprint=fingerprint,
                              programs=[ProgramRequest(spec=s) for _, s in misses[i:i + size]]),
               [r for r, _ in misses[i:i + size]]) for i in range(0, len(misses), size)]
    sent = client.send(fingerprint, chunks, progress=notify, status=status)
    return BatchReport(results=results, wall_s=time.perf_counter() - start,
                       parallelism=len({r.worker for r in results if r.worker}) or 1,
                       compiler_invocations=sum(1 for r in results
                                                if r.outcome is Outcome.COMPILED),
                       tasks_sent=sent)
