"""Building a capture ahead of time: ``farm build CAPTURE [--cluster] [--fingerprint FP]``.

For each target fingerprint (every one the capture names, or ``--fingerprint``), the
programs whose key the store lacks are compiled: here, on a pool of this machine's
compile processes when the local device has that fingerprint; or on the cluster's pool
of that fingerprint, each chunk a task that carries specs (digests), the sources and
headers put into the store's blobs first. Outcomes and reports are a batch's
(:class:`~farm.compilation.batch.BatchReport`), one per fingerprint, so ``farm build``
prints them as it prints a manifest's; each program appears as ``program(key=...)``.

Where the capture recorded launches for the fingerprint (PoCL's CPU drivers), each
program's work-group functions for them are made too and stored beside it
(:mod:`farm.programs.making`): here, on a few isolated children as each program is
stored; on the cluster, by the worker that builds (or finds) the program, which gets the
launches with the spec. What was made is a :class:`~farm.programs.making.Readiness`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
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
from farm.programs.making import Coverage, Makers, Readiness, coverage, make_ready, wanted
from farm.programs.proving import compiled_here
from farm.programs.spec import ProgramSpec
from farm.programs.supplements import Launched
from farm.records import Recorder
from farm.records.model import Trip
from farm.store.base import ArtifactStore

if TYPE_CHECKING:
    from farm.cluster.client import ClusterClient

Progress = Callable[[KernelResult], None]
Status = Callable[[str], None]


@dataclass
class Built:
    """A capture built for one fingerprint: the batch's report, and what was made of the
    capture's launches there (``None``: none recorded, or the device needs none)."""

    report: BatchReport
    ready: Readiness | None = None


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
             notify: Progress, checked: ArtifactStore | None = None
             ) -> tuple[list[KernelResult], list[tuple[KernelResult, ProgramSpec]]]:
    """Every program's result, and the misses (the store lacks their key, or holds a
    damaged artifact there: a listing proves a name, not an artifact, so each held one
    is read and checked, by ``checked`` when given, a client's verifying store, before
    it counts as Loaded, issue 33)."""
    results = [KernelResult(artifact=handle(s), key=s.key) for s in specs]
    held = store.existing(ns, [s.key for s in specs])
    misses = []
    for res, spec in zip(results, specs, strict=True):
        if spec.key in held and (checked or store).get(ns, spec.key) is not None:
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
               progress: Progress | None = None, status: Status | None = None) -> Built:
    """Compile the capture's programs for ``device`` on this machine's compile pool, and
    make the work-group functions of their recorded launches."""
    start = time.perf_counter()
    notify = progress or (lambda r: None)
    specs = targets(capture, device.fingerprint).get(device.fingerprint, [])
    ns = Namespace.for_fingerprint(device.fingerprint)
    results, misses = _results(store, ns, specs, notify)
    ready = _Ready(settings, device, capture, store, max(1, workers), status)
    try:
        for res, spec in zip(results, specs, strict=True):
            if res.outcome is Outcome.LOADED:
                ready.submit(spec)
        if misses:
            put_blobs(store, capture, [s for _, s in misses])
            jobs = [(ProgramJob(spec=spec, blobs={d: capture.blob(d) for d in spec.digests()},
                                ready=settings.pocl_ready), res, spec) for res, spec in misses]
            pool = ProcessPoolCompiler(device, max(1, workers), settings.native_binaries,
                                       crash_limit=settings.crash_limit)
            with _closed(pool):
                futures: dict[Future[FinalizeResult], tuple[KernelResult, ProgramSpec]] = {
                    pool.submit_job(pool_compile, job.model_dump_json()): (res, spec)
                    for job, res, spec in jobs}
                for fut in as_completed(futures):
                    res, spec = futures[fut]
                    _finish(store, device, res, spec, fut.result(), recorder)
                    notify(res)
                    if res.outcome is Outcome.COMPILED:
                        ready.submit(spec)
        store_plan(store, capture, device.fingerprint, results, specs)
        report = BatchReport(results=results, wall_s=time.perf_counter() - start,
                             parallelism=max(1, workers), compiler_invocations=len(misses))
        return Built(report, ready.finish())
    except BaseException:  # interrupted (SIGINT, or SIGTERM made one): stop the makers now
        ready.close(now=True)
        raise


@contextlib.contextmanager
def _closed(pool: ProcessPoolCompiler) -> Iterator[None]:
    """``pool`` closed on the way out: at once when interrupted (SIGINT, or SIGTERM made
    one), its processes stopped mid-compile."""
    try:
        yield
    except BaseException:
        pool.close(now=True)
        raise
    pool.close()


class _Ready:
    """The work-group functions of a local build's programs, made as each program is
    stored, on ``size`` threads each driving one isolated child."""

    def __init__(self, settings: Settings, device: DeviceInfo, capture: CaptureFile,
                 store: ArtifactStore, size: int, status: Status | None) -> None:
        self._want = wanted(capture, device.fingerprint) if (
            device.compiles_at_launch and settings.pocl_ready) else {}
        self._device, self._store, self._status = device, store, status
        self._start = time.perf_counter()
        self._futures: list[Future[Readiness]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._makers: Makers | None = None
        if self._want:
            specs = frozenset(s for pairs in self._want.values() for _, s in pairs)
            self._makers = Makers(device, specs, size)
            self._pool = ThreadPoolExecutor(size, thread_name_prefix="kernel-farm make")

    def submit(self, spec: ProgramSpec) -> None:
        want = self._want.get(spec.key.id_hash)
        if want and self._pool is not None and self._makers is not None:
            self._futures.append(self._pool.submit(make_ready, self._store, self._device,
                                                   spec.key, want, self._makers))

    def finish(self) -> Readiness | None:
        """Wait for every program submitted; what was made (``None``: nothing wanted)."""
        if not self._want:
            return None
        out = Readiness()
        for i, fut in enumerate(as_completed(self._futures)):
            if self._status is not None:
                self._status(f"work-group functions: {i}/{len(self._futures)} programs")
            out.add(fut.result())
        out.wall_s = time.perf_counter() - self._start
        self.close()
        return out

    def close(self, now: bool = False) -> None:
        """End the threads and children (``now``: the children first, mid-request)."""
        if self._makers is not None and now:
            self._makers.kill()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._makers is not None:
            self._makers.close()


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
                     status: Status | None = None) -> Built:
    """Send the programs ``client.store`` lacks for ``fingerprint`` to its workers (whose
    liveness the caller checked: ``client.served``), with their recorded launches; and
    the programs it holds whose records lack some of their launches' functions, which
    the workers then make."""
    from farm.programs.request import ChunkRequest, ProgramRequest

    start = time.perf_counter()
    notify = progress or (lambda r: None)
    specs = targets(capture, fingerprint).get(fingerprint, [])
    ns = Namespace.for_fingerprint(fingerprint)
    # with a verify key the client counts only what it verified itself (issue 33)
    verify = bool(client.settings.verify_key)
    results, misses = _results(client.store, ns, specs, notify,
                               checked=client.checked_store() if verify else None)
    if misses:
        put_blobs(client.store, capture, [s for _, s in misses])
    want = wanted(capture, fingerprint)
    before = _covered(client.store, ns, specs, want)
    # held programs whose functions are not all stored: sent too (reported once, above)
    unready = [(KernelResult(artifact=handle(s), key=s.key), s) for r, s in zip(
        results, specs, strict=True) if r.outcome is Outcome.LOADED
               and s.key.id_hash in want and (s.key.id_hash not in before
                                              or before[s.key.id_hash].missing)]
    counted = {id(r) for r, _ in misses}
    todo = misses + unready
    size = client.settings.chunk_size
    chunks = [(ChunkRequest(fingerprint=fingerprint, programs=[
        ProgramRequest(spec=s, launches=_launches(want.get(s.key.id_hash)))
        for _, s in todo[i:i + size]]), [r for r, _ in todo[i:i + size]])
        for i in range(0, len(todo), size)]
    sent = client.send(fingerprint, chunks, status=status,
                       progress=lambda r: notify(r) if id(r) in counted else None)
    if verify:
        client.check_replies(ns, [r for r, _ in misses])
    store_plan(client.store, capture, fingerprint, results, specs)
    report = BatchReport(results=results, wall_s=time.perf_counter() - start,
                         parallelism=len({r.worker for r in results if r.worker}) or 1,
                         compiler_invocations=sum(1 for r in results
                                                  if r.outcome is Outcome.COMPILED),
                         tasks_sent=sent)
    if not want:
        return Built(report)
    return Built(report, _cluster_readiness(client.store, ns, specs, want, before))


def store_plan(store: ArtifactStore, capture: CaptureFile, fingerprint: str,
               results: list[KernelResult], specs: list[ProgramSpec]) -> None:
    """Store the captured applications' plan on ``fingerprint`` (the programs held or
    built there, in the capture's order: :mod:`farm.programs.plan`), so that a node
    prepared only from the capture proves them ahead, while the application starts, as
    a node whose programs came from a real run does. A plan is data (program keys): the
    worst a wrong one does is make a node prove programs it will not ask for."""
    from farm.programs.plan import store_plans

    keys = [s.key.id_hash for r, s in zip(results, specs, strict=True)
            if r.outcome in (Outcome.LOADED, Outcome.COMPILED)]
    for app in capture.applications if keys else ():
        store_plans(store, app, {fingerprint: keys})


def _launches(pairs: frozenset[tuple[str, str]] | None) -> tuple[Launched, ...]:
    return tuple(x for p in sorted(pairs or ()) if (x := Launched.of(p)) is not None)


def _covered(store: ArtifactStore, ns: Namespace, specs: list[ProgramSpec],
             want: dict[str, frozenset[tuple[str, str]]]) -> dict[str, Coverage]:
    """Program key's id hash -> what the store holds of it and of its wanted functions,
    for every program with launches that the store holds (read on a few threads: one or
    two round trips each)."""
    todo = [s for s in specs if s.key.id_hash in want]
    if not todo:
        return {}

    def one(spec: ProgramSpec) -> tuple[str, Coverage]:
        return spec.key.id_hash, coverage(store, ns, spec.key, want[spec.key.id_hash])

    with ThreadPoolExecutor(min(8, len(todo))) as pool:
        return {k: c for k, c in pool.map(one, todo) if c.body is not None}


def _cluster_readiness(store: ArtifactStore, ns: Namespace, specs: list[ProgramSpec],
                       want: dict[str, frozenset[tuple[str, str]]],
                       before: dict[str, Coverage]) -> Readiness:
    """What the workers made, told by the store's records after the build."""
    after = _covered(store, ns, specs, want)
    out = Readiness()
    for spec in specs:
        if spec.key.id_hash not in want:
            continue
        out.programs += 1
        was = before.get(spec.key.id_hash, Coverage())
        now = after.get(spec.key.id_hash)
        if now is None:
            out.failed.append((str(spec.key), "the program is not in the store"))
            continue
        out.held += len(was.held)
        out.made += len(now.held - was.held)
        out.ignored += len(now.ignored)
        if now.missing:
            out.failed.append((str(spec.key), f"{len(now.missing)} work-group function(s) "
                                              "not made on the workers (their log says why)"))
    return out
