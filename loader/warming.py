"""Warm a whole manifest: every kernel on the device now, from the fastest place that has it.

Order of work, chosen so that nothing per kernel is serialized behind the network:

1. **look-up**: every key computed (no expansion), memory consulted, then one bulk
   ``existing`` per store tier for what memory lacks (front tier first, later tiers
   only for what the earlier ones lack: a single listing of MinIO, not a request per key);
2. **fetch + load** on a pool of threads: each thread fetches one artifact from the first
   tier that holds it (digest verified), loads it on the device, and copies a remote hit
   into the local tier after the load. Network waits overlap; the device loads are
   milliseconds each;
3. **compile**: what no tier holds (or what a tier held corrupt, or the device refused)
   goes, per ``on_miss``, to the farm's batch here, to the cluster's workers, or is
   reported missing.

The result says where each kernel came from (memory, local, remote, compiled, rekeyed,
farm) and what each phase took; it is recorded as *one* compilation batch record, with a
compilation record for every kernel that was not a memory hit.

Several threads of one loader asking for the same kernels are served once: warm claims
the loader's in-flight table for the keys it fetches, and waits on keys another thread
is already fetching.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.compilation.batch import BatchReport, KernelResult
from farm.core.errors import FarmError
from farm.core.model import Artifact, ArtifactId, KernelFailure, Key
from farm.core.outcomes import Fate
from farm.manifest import Manifest, expand, load_manifest, resolve_manifest
from farm.records.model import BatchCounts
from loader.errors import failure_error
from loader.items import Phase, WarmItem, WarmProgress
from loader.programs import SOURCES, InFlight, LoadedProgram, Source, source_of
from loader.readiness import launch_all
from loader.readiness import summary as readiness_summary

if TYPE_CHECKING:
    from loader.base import LoaderBase

PHASES = ("lookup", "fetch", "load", "compile", "launch")
#: an artifact read ahead of its load (``None``: the tier did not hold it), and the read's time
Prefetched = tuple[Artifact | None, float]

#: threads fetching at once: enough to hide MinIO round trips, within its connection pool
DEFAULT_THREADS = 16
#: artifacts read ahead while the device's context is being made (bounds the memory)
MAX_PREFETCH = 4096
#: threads when every fetch is local: the SQLite file is read under one lock, so more
#: threads only queue on it; a few overlap reads with device loads
LOCAL_THREADS = 4


@dataclass
class WarmReport:
    """Every kernel's fate in request order, where they came from, and the phase times."""

    label: str
    fingerprint: str
    items: list[WarmItem]
    wall_s: float
    phases: dict[str, Phase]
    threads: int
    compiler_invocations: int = 0
    parallelism: int = 1
    batch_seq: int | None = None

    def count(self, source: Source) -> int:
        return sum(1 for i in self.items if i.source == source)

    @property
    def unsupported(self) -> list[WarmItem]:
        return [i for i in self.items if i.failure and i.failure.kind == Fate.UNSUPPORTED]

    @property
    def failed(self) -> list[WarmItem]:
        return [i for i in self.items if i.failure and i.failure.kind != Fate.UNSUPPORTED]

    @property
    def work_s(self) -> float:
        return sum(i.work_s for i in self.items)

    def counts(self) -> BatchCounts:
        """What the batch record keeps: every kernel that came from memory, a tier or the
        farm counts as loaded here."""
        return BatchCounts(
            kernels=len(self.items),
            loaded=sum(self.count(s) for s in (Source.MEMORY, Source.LOCAL, Source.REMOTE,
                                               Source.FARM)),
            rekeyed=self.count(Source.REKEYED), compiled=self.count(Source.COMPILED),
            unsupported=len(self.unsupported), failed=len(self.failed),
            parallelism=self.parallelism, wall_s=self.wall_s, work_s=self.work_s)

    def summary(self) -> dict[str, Any]:
        n = len(self.items)
        return {
            "manifest": self.label,
            "fingerprint": self.fingerprint,
            "kernels": n,
            **{s: self.count(s) for s in SOURCES},
            Fate.UNSUPPORTED: len(self.unsupported),
            Fate.FAILED: len(self.failed),
            "native_fallbacks": sum(1 for i in self.items if i.native_fallback),
            "compiler_invocations": self.compiler_invocations,
            "threads": self.threads,
            "wall_s": round(self.wall_s, 4),
            "work_s": round(self.work_s, 4),
            "per_kernel_ms": round(1000 * self.wall_s / n, 3) if n else 0.0,
            "phases": {name: p.summary() for name, p in self.phases.items()},
            "readiness": readiness_summary(self.items),
        }


def artifacts_of(manifest: Manifest | str | Path | Iterable[ArtifactId],
                 loader: LoaderBase) -> tuple[list[ArtifactId], str]:
    """(artifact ids, label) of a manifest object, file or built-in name, or of ids."""
    if isinstance(manifest, str | Path):
        manifest = load_manifest(resolve_manifest(str(manifest)))
    if isinstance(manifest, Manifest):
        return [e.artifact for e in expand(manifest, loader.registry)], manifest.label
    return list(manifest), "artifacts"


def warm_loader(loader: LoaderBase, manifest: Manifest | str | Path | Iterable[ArtifactId],
                *, progress: WarmProgress | None = None, threads: int | None = None,
                label: str | None = None, launch: bool = False) -> WarmReport:
    """The engine behind :func:`warm` and :meth:`KernelLoader.warm`; ``label`` names the
    warm in its summary and batch record (default: the manifest's name)."""
    artifacts, default_label = artifacts_of(manifest, loader)
    report = _Warm(loader, label or default_label, progress, threads).run(artifacts)
    if launch:
        launch_all(loader, report.items, report.phases["launch"])
    return report


class _Warm:
    """One warm: its items, their grouping by key, and the claimed in-flight futures."""

    def __init__(self, loader: LoaderBase, label: str, progress: WarmProgress | None,
                 threads: int | None) -> None:
        self.loader = loader
        self.label = label
        self.notify: WarmProgress = progress or (lambda item: None)
        self.threads = max(1, threads or DEFAULT_THREADS)
        self.chosen_threads = threads is not None
        self.phases = {name: Phase() for name in PHASES}
        self.groups: dict[Key, list[WarmItem]] = {}
        #: key -> (cache key, future) this warm must settle
        self.claimed: dict[Key, tuple[tuple[int, Key], Future[LoadedProgram]]] = {}
        self.compiler_invocations = 0
        self.parallelism = 0

    def run(self, artifacts: list[ArtifactId]) -> WarmReport:
        start = time.perf_counter()
        items = [WarmItem(artifact=a) for a in artifacts]
        try:
            first_tier, misses, joined = self._lookup(items)
            misses += self._fetch_all(first_tier)
            self._obtain_misses(misses)
            self._wait(joined)
        except BaseException as exc:  # never leave another thread waiting on a claim
            for ck, fut in list(self.claimed.values()):
                self.loader.inflight.settle(ck, fut, None, exc)
            self.claimed.clear()
            raise
        wall = time.perf_counter() - start
        report = WarmReport(label=self.label, fingerprint=self.loader.device.fingerprint,
                            items=items, wall_s=wall, phases=self.phases,
                            threads=self.threads,
                            compiler_invocations=self.compiler_invocations,
                            parallelism=self.parallelism or self.threads)
        rec = self.loader.recorder.batch(report.counts(), label=f"warm {self.label}")
        report.batch_seq = rec.stamp.seq if rec is not None else None
        return report

    # -- 1. look-up ----------------------------------------------------------------------
    def _lookup(self, items: list[WarmItem]
                ) -> tuple[dict[Key, int], list[Key],
                           dict[tuple[int, Key], Future[LoadedProgram]]]:
        t0 = time.perf_counter()
        loader = self.loader
        for item in items:
            try:
                item.key = loader.key_of(item.artifact)
            except FarmError as exc:
                self._fail([item], KernelFailure(kind="validation", message=str(exc)))
                continue
            self.groups.setdefault(item.key, []).append(item)
        wanted: list[tuple[int, Key]] = []
        for key, group in self.groups.items():
            ck = InFlight.key(key)
            if loader.inflight.get(ck) is not None:
                loader.stats.bump("memory", len(group))
                self._done(group, Source.MEMORY)
            else:
                wanted.append(ck)
        claimed, joined = loader.inflight.claim(wanted)
        self.claimed = {ck[1]: (ck, fut) for ck, fut in claimed.items()}
        remaining = set(self.claimed)
        first_tier: dict[Key, int] = {}
        for i, tier in enumerate(loader.tiers):
            if not remaining:
                break
            held = tier.store.existing(loader.namespace, remaining)
            for key in held:
                first_tier[key] = i
            remaining -= held
        misses = [k for k in self.groups if k in remaining]  # request order
        self.phases["lookup"].add(t0, time.perf_counter(), kernels=len(items))
        return first_tier, misses, joined

    # -- 2. fetch and load on threads ------------------------------------------------------
    def _fetch_one(self, key: Key, tier: int, read: Future[Prefetched] | None = None
                   ) -> tuple[Key, Any, dict[str, float], float]:
        timings: dict[str, float] = {}
        start = time.perf_counter()
        got = self.loader.fetcher.fetch_and_load(self.groups[key][0].artifact, key, tier, timings,
                                         prefetched=read.result() if read else None)
        return key, got, timings, start

    def _read(self, key: Key, tier: int) -> Prefetched:
        return self.loader.fetcher.read(tier, key)

    def _fetch_all(self, first_tier: dict[Key, int]) -> list[Key]:
        """Fetch and load every held key; return the keys that turned out to be misses."""
        if not first_tier:
            return []
        misses: list[Key] = []
        if not self.chosen_threads and all(
                self.loader.tiers[t].name == "local" for t in first_tier.values()):
            self.threads = min(self.threads, LOCAL_THREADS)
        workers = min(self.threads, len(first_tier))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="farm-warm") as pool:
            reads: dict[Key, Future[Prefetched]] = {}
            if not self.loader.context_ready:
                # The context is still being made (seconds on a GPU): read and verify the
                # artifacts meanwhile, so that only the loads wait for it. Reads are
                # queued first, so no load waits on a read that has not started.
                for k, t in list(first_tier.items())[:MAX_PREFETCH]:
                    reads[k] = pool.submit(self._read, k, t)
            futures = [pool.submit(self._fetch_one, k, t, reads.get(k))
                       for k, t in first_tier.items()]
            for fut in as_completed(futures):
                key, got, timings, start = fut.result()
                fetch_s, load_s = timings.get("fetch_s", 0.0), timings.get("load_s", 0.0)
                self.phases["fetch"].add(start, start + fetch_s)
                if load_s:
                    self.phases["load"].add(start + fetch_s, start + fetch_s + load_s)
                if got is None:  # corrupt, vanished or refused in every tier
                    misses.append(key)
                    continue
                entry, tier = got
                group = self.groups[key]
                self.loader.stats.bump(tier.name)
                self.loader.record_loaded(entry, fetch_s + load_s, group[0].label)
                for item in group:
                    item.fetch_s, item.load_s = fetch_s, load_s
                    item.native_fallback = entry.native_fallback
                item = group[0]
                item.work_s = fetch_s + load_s
                self._settle(key, entry)
                self._done(group, Source(tier.name))
        order = {k: i for i, k in enumerate(self.groups)}
        return sorted(misses, key=order.__getitem__)

    # -- 3. what no tier holds --------------------------------------------------------------
    def _obtain_misses(self, misses: list[Key]) -> None:
        if not misses:
            return
        loader = self.loader
        t0 = time.perf_counter()
        if loader.on_miss == "fail":
            for key in misses:
                self._fail(self.groups[key], KernelFailure(
                    kind="error", message=f"{self.groups[key][0].artifact.describe()}: no "
                    f"store tier holds key {key} for {loader.namespace} (on_miss='fail')"))
            return
        by_id = {self.groups[k][0].artifact.id_hash: k for k in misses}
        artifacts = [self.groups[k][0].artifact for k in misses]
        report: BatchReport
        if loader.on_miss == "farm":
            report = loader.farm_batch(artifacts, label=f"warm {self.label}")
            for res in report.results:
                self._farm_result(by_id[res.artifact.id_hash], res)
        else:
            def on_result(res: KernelResult) -> None:
                self._compile_result(by_id[res.artifact.id_hash], res)

            report = loader.compile_batch(artifacts, progress=on_result,
                                          label=f"warm {self.label}")
        self.compiler_invocations += report.compiler_invocations
        self.parallelism = report.parallelism
        self.phases["compile"].add(t0, time.perf_counter(), work_s=report.work_s,
                                   kernels=len(misses))

    def _compile_result(self, key: Key, res: KernelResult) -> None:
        group = self.groups[key]
        if res.failure is not None:
            self._fail(group, res.failure)
            return
        assert res.program is not None
        source = source_of(res.outcome)
        self.loader.stats.bump(source.value)
        group[0].work_s = res.work_s
        self._settle(key, LoadedProgram.of(res.program, res.artifact.kernel.family, key))
        self._done(group, source)

    def _farm_result(self, key: Key, res: KernelResult) -> None:
        group = self.groups[key]
        if res.failure is not None:
            self._fail(group, res.failure)
            return
        timings: dict[str, float] = {}
        got = self.loader.fetcher.fetch_and_load(group[0].artifact, key, 0, timings)
        if got is None:
            self._fail(group, KernelFailure(kind="error", message=f"the farm reported "
                                            f"{res.outcome} but no store tier serves it"))
            return
        self.loader.stats.bump("farm")
        group[0].work_s = res.work_s + timings.get("fetch_s", 0.0) + timings.get("load_s", 0.0)
        self.loader.record_loaded(got[0], timings.get("fetch_s", 0.0) + timings.get("load_s", 0.0),
                                  group[0].label)
        self._settle(key, got[0])
        self._done(group, Source.FARM)

    # -- 4. keys other threads were fetching ------------------------------------------------
    def _wait(self, joined: dict[tuple[int, Key], Future[LoadedProgram]]) -> None:
        for (_, key), fut in joined.items():
            group = self.groups[key]
            try:
                fut.result()
            except FarmError as exc:
                self._fail(group, KernelFailure(kind="error", message=str(exc)))
                continue
            self.loader.stats.bump("joined", len(group))
            self._done(group, Source.MEMORY)

    # -- bookkeeping ---------------------------------------------------------------------------
    def _settle(self, key: Key, entry: LoadedProgram | None,
                error: BaseException | None = None) -> None:
        """Hand a claimed key's program (or error) to the loader's table and waiters."""
        claim = self.claimed.pop(key, None)
        if claim is not None:
            ck, fut = claim
            self.loader.inflight.settle(ck, fut, entry, error)

    def _done(self, group: list[WarmItem], source: Source) -> None:
        for item in group:
            item.source = source
            self.notify(item)

    def _fail(self, group: list[WarmItem], failure: KernelFailure) -> None:
        for item in group:
            item.failure = failure
            self.notify(item)
        key = group[0].key
        if key is not None:
            self._settle(key, None, failure_error(group[0].label, failure))

