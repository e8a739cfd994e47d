"""A batch: obtain many kernels together, each Loaded, Rekeyed or Compiled.

Order of work, chosen so the compiler (the expensive part) starts as early as possible
and nothing per kernel is serialized behind it:

1. compute every key (no expansion needed) and ask the store which it holds, in bulk;
2. lower the misses on threads; a miss whose source the index knows is *rekeyed*
   (see :mod:`farm.compilation.rekey`); the rest are grouped by source and each group's first
   kernel (its leader) is sent to the compiler, the others reuse its artifact;
3. while the compiler works, load the hits (verifying digests; a corrupt or refused
   hit becomes a miss that is compiled again, which repairs the store);
4. store each compiled binary as it arrives, only after a load succeeded.

Where loads happen: with ``keep_programs`` (a loader, ``farm warm``) every kernel is
loaded here, in order, because the caller wants the programs in its own context. Without
it (``farm build``, whose job is to fill the store) a hit is read and its digest
verified but not loaded, and a compiled binary is validated by a load in the process
that compiled it. On NVIDIA a load is a PTX JIT of tens of milliseconds: loading every
kernel in this one thread would serialize the whole build behind it.

Stored binaries the farm did not validate on this fingerprint (``origin="imported"``)
are loaded in a child process first (:mod:`farm.compilation.validate`), also when this
batch keeps no programs: a hit is counted Loaded only when this device loads it there.
A hit proven bad on this device (refused, or fatal to the child) is quarantined and
compiled again, so the repair is stored (the rules: :mod:`farm.compilation.obtain`).

A kernel that fails is reported with its error and build log and nothing of it is
stored; the others go on. The batch's work is the sum of its kernels' work; its wall
time runs from its start to its last load.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from farm.compilation.finalize import FinalizeResult
from farm.compilation.load import LoadedBinary, load_binary
from farm.compilation.obtain import Obtainer, compiled_artifact, store_key
from farm.compilation.proofs import ProofBook, Prover, prove_family
from farm.core.device import DeviceContext, DeviceInfo
from farm.core.errors import FarmError, KernelError, LoadError
from farm.core.keys import Namespace
from farm.core.model import Artifact, ArtifactId, KernelFailure, Key, Lowered
from farm.core.outcomes import Fate, Outcome
from farm.families import Registry
from farm.records.model import BatchCounts, Trip
from farm.store.base import ArtifactStore

if TYPE_CHECKING:
    import pyopencl as cl

    from farm.compilation.compiler import Compiler
    from farm.records.recorder import Recorder

log = logging.getLogger(__name__)

Progress = Callable[["KernelResult"], None]

#: the steps a kernel's work is split into in a report's ``work_parts``: lowering and
#: the artifact's store write happen in the requesting process (``lower``, ``store``,
#: which also counts a load there); ``compile``, ``native`` (the link to machine code)
#: and ``validate`` (the validating load) where it was compiled; ``fetch`` is reading
#: a stored artifact (hits and rekeys); ``worker`` is a cluster worker's whole work on a
#: kernel (its steps are in that worker's records)
WORK_PARTS = ("lower", "compile", "native", "validate", "store", "fetch", "worker")


@dataclass
class KernelResult:
    """What happened to one kernel of a batch."""

    artifact: ArtifactId
    key: Key | None = None
    outcome: Outcome | None = None
    failure: KernelFailure | None = None
    work_s: float = 0.0
    worker: str = ""
    #: the loaded program, when the batch keeps programs
    program: cl.Program | None = None
    #: why a native artifact's machine code was refused and its portable part loaded
    native_fallback: str = ""
    #: ``work_s`` by step (:data:`WORK_PARTS`), so a slow build says where it went
    parts: dict[str, float] = field(default_factory=dict)

    def add_part(self, part: str, seconds: float) -> None:
        self.work_s += seconds
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    @property
    def label(self) -> str:
        return self.artifact.kernel.label()


@dataclass
class BatchReport:
    """The batch's results in request order, and what it cost."""

    results: list[KernelResult]
    wall_s: float
    parallelism: int
    compiler_invocations: int
    batch_seq: int | None = None
    #: cluster builds: compile tasks sent to the workers
    tasks_sent: int = 0
    #: kernels the client found in the store itself, before asking any worker (a
    #: cluster build sets it; a local build's are its Loaded kernels)
    store_hits: int | None = None

    @property
    def work_s(self) -> float:
        return sum(r.work_s for r in self.results)

    def count(self, outcome: Outcome) -> int:
        return sum(1 for r in self.results if r.outcome is outcome)

    @property
    def unsupported(self) -> list[KernelResult]:
        return [r for r in self.results if r.failure and r.failure.kind == Fate.UNSUPPORTED]

    @property
    def failed(self) -> list[KernelResult]:
        return [r for r in self.results if r.failure and r.failure.kind != Fate.UNSUPPORTED]

    def counts(self) -> BatchCounts:
        """What the batch record keeps of this report."""
        return BatchCounts(kernels=len(self.results), loaded=self.count(Outcome.LOADED),
                           rekeyed=self.count(Outcome.REKEYED),
                           compiled=self.count(Outcome.COMPILED),
                           unsupported=len(self.unsupported), failed=len(self.failed),
                           parallelism=self.parallelism, wall_s=self.wall_s,
                           work_s=self.work_s)

    def summary(self) -> dict[str, Any]:
        wall = self.wall_s
        return {
            "kernels": len(self.results),
            **{outcome.fate: self.count(outcome) for outcome in Outcome},
            Fate.UNSUPPORTED: len(self.unsupported),
            Fate.FAILED: len(self.failed),
            "work_s": round(self.work_s, 4),
            "wall_s": round(wall, 4),
            "speedup": round(self.work_s / wall, 2) if wall > 0 else 0.0,
            "parallelism": self.parallelism,
            "compiler_invocations": self.compiler_invocations,
            "tasks_sent": self.tasks_sent,
            "store_hits": (self.count(Outcome.LOADED) if self.store_hits is None
                           else self.store_hits),
            "native_fallbacks": sum(1 for r in self.results if r.native_fallback),
            "work_parts": {part: round(sum(r.parts.get(part, 0.0) for r in self.results), 4)
                           for part in WORK_PARTS},
        }


@dataclass
class _Pending:
    """A miss on its way through lower -> (rekey | compile) -> load -> store."""

    result: KernelResult
    family: str
    lowered: Lowered | None = None
    started: float = 0.0
    followers: list[_Pending] = field(default_factory=list)


class Batch:
    """Obtains kernels on one device. Reusable: one ``run`` per batch.

    ``ctx`` opens the device's context on the first load (a batch of hits that keeps no
    programs never needs one). ``record_batch`` False: the caller records one batch of
    its own (a loader's warm).
    """

    def __init__(self, *, registry: Registry, ctx: DeviceContext, store: ArtifactStore,
                 compiler: Compiler, recorder: Recorder | None = None,
                 keep_programs: bool = False, label: str = "",
                 record_batch: bool = True) -> None:
        self.registry = registry
        self.device: DeviceInfo = ctx.info
        self._context = ctx
        self.store = store
        self.ns = Namespace.for_fingerprint(self.device.fingerprint)
        self.compiler = compiler
        self.recorder = recorder
        self.keep_programs = keep_programs
        self.label = label
        self.record_batch = record_batch
        #: the proofs of stored binaries (docs/SECURITY.md): the caller's, sharing the
        #: node's book (:attr:`prover`), else a child of this batch's own, made on first
        #: use and closed at the end of each run
        self.prover: Prover | None = None
        self._own_prover: Prover | None = None
        #: the rules; a kernel found in the store is loaded here only to keep its program
        self.rules = Obtainer(store, self.ns, self._load if keep_programs else None,
                              validate=self._validate)

    # -- entry point ---------------------------------------------------------------------
    def run(self, artifacts: Iterable[ArtifactId],
            progress: Progress | None = None) -> BatchReport:
        try:
            return self._run(artifacts, progress)
        finally:
            if self._own_prover is not None:
                self._own_prover.close()
                self._own_prover = None

    def _run(self, artifacts: Iterable[ArtifactId],
             progress: Progress | None = None) -> BatchReport:
        start = time.perf_counter()
        results = [KernelResult(artifact=a) for a in artifacts]
        notify = progress or (lambda r: None)
        invocations = 0

        # 1. keys, then one bulk look-up
        for res in results:
            try:
                res.key = store_key(self.registry, res.artifact)
            except FarmError as exc:
                self._fail(res, "validation", str(exc), notify)
        keyed = [r for r in results if r.key is not None]
        held = self.store.existing(self.ns, [r.key for r in keyed if r.key])
        hits = [r for r in keyed if r.key in held]
        misses = [_Pending(result=r, family=r.artifact.kernel.family)
                  for r in keyed if r.key not in held]

        # 2. lower misses, rekey what the source index knows, send the rest to compile
        futures: dict[Future[FinalizeResult], _Pending] = {}
        invocations += self._dispatch(misses, futures, notify)

        # 3. load hits while the compiler works
        late: list[_Pending] = []
        for res in hits:
            t = time.perf_counter()
            assert res.key is not None
            found = self.rules.stored(res.key, names=functools.partial(self._declared, res))
            if found is None:  # corrupt or refused: a miss that recompiling repairs
                late.append(_Pending(result=res, family=res.artifact.kernel.family,
                                     started=t))
                continue
            res.add_part("fetch", time.perf_counter() - t)
            self._done(res, Outcome.LOADED, notify, loaded=found.loaded)
        invocations += self._dispatch(late, futures, notify, rekey=False)

        # 4. load compiled binaries as they arrive, store after a successful load
        for fut in as_completed(list(futures)):
            self._finish_compile(futures[fut], fut.result(), notify)

        report = BatchReport(results=results, wall_s=time.perf_counter() - start,
                             parallelism=self.compiler.parallelism,
                             compiler_invocations=invocations)
        if self.recorder is not None and self.record_batch:
            rec = self.recorder.batch(report.counts(), label=self.label)
            report.batch_seq = rec.stamp.seq if rec is not None else None
        return report

    # -- steps -----------------------------------------------------------------------------
    def _lower(self, pending: _Pending) -> None:
        t = time.perf_counter()
        family = self.registry.get(pending.family)
        pending.lowered = family.lower_id(pending.result.artifact, self.device)
        pending.result.add_part("lower", time.perf_counter() - t)

    def _dispatch(self, pendings: list[_Pending],
                  futures: dict[Future[FinalizeResult], _Pending], notify: Progress,
                  rekey: bool = True) -> int:
        """Lower ``pendings`` in parallel; rekey or submit each. Returns compiles sent."""
        if not pendings:
            return 0
        with ThreadPoolExecutor(max_workers=4) as pool:
            lowered = list(pool.map(self._try_lower, pendings))
        leaders: dict[str, _Pending] = {}
        sent = 0
        for pending, error in zip(pendings, lowered, strict=True):
            if error is not None:
                self._fail(pending.result, error.kind if error.kind != "error"
                           else "validation", str(error), notify)
                continue
            assert pending.lowered is not None
            source_hash = pending.lowered.source_hash
            if source_hash in leaders:
                leaders[source_hash].followers.append(pending)
                continue
            if rekey and self._try_rekey(pending, notify):
                continue
            leaders[source_hash] = pending
            futures[self.compiler.submit(pending.lowered)] = pending
            sent += 1
        return sent

    def _try_lower(self, pending: _Pending) -> KernelError | None:
        try:
            self._lower(pending)
        except KernelError as exc:
            return exc
        except FarmError as exc:  # parameter errors surface here for hand-made ids
            return KernelError(str(exc))
        return None

    def _try_rekey(self, pending: _Pending, notify: Progress) -> bool:
        res, lowered = pending.result, pending.lowered
        assert res.key is not None and lowered is not None
        t = time.perf_counter()
        found = self.rules.reusable(res.key, pending.family, lowered)
        if found is None:
            return False
        self.rules.keep_reused(found, res.key, pending.family, lowered)
        res.add_part("fetch", time.perf_counter() - t)
        self._done(res, Outcome.REKEYED, notify, found.loaded, lowered)
        return True

    def _finish_compile(self, leader: _Pending, built: FinalizeResult,
                        notify: Progress) -> None:
        group = [leader, *leader.followers]
        if not built.ok:
            for p in group:
                if p is leader:
                    p.result.add_part("compile", built.work_s)
                self._fail(p.result, built.error_kind, built.error, notify, built.build_log)
            return
        t = time.perf_counter()
        res, lowered = leader.result, leader.lowered
        assert lowered is not None and res.key is not None
        loaded: LoadedBinary | None = None
        if self.keep_programs or not built.validated:
            try:
                loaded = self._load(built.binary, lowered.kernel_names)
            except LoadError as exc:
                for p in group:
                    self._fail(p.result, "load", str(exc), notify, built.build_log)
                return
        art = compiled_artifact(res.key, leader.family, built, lowered.source_hash)
        self.rules.keep(res.key, leader.family, art, lowered)
        res.worker = built.worker
        res.add_part("compile", max(0.0, built.work_s - built.native_s - built.validate_s))
        res.add_part("native", built.native_s)
        res.add_part("validate", built.validate_s)
        res.add_part("store", time.perf_counter() - t)
        self._done(res, Outcome.COMPILED, notify, loaded, lowered)
        for p in leader.followers:
            assert p.result.key is not None
            self.rules.keep(p.result.key, p.family, art, p.lowered)
            self._done(p.result, Outcome.REKEYED, notify, loaded, p.lowered)

    def _declared(self, res: KernelResult) -> tuple[str, ...]:
        """The kernel names the family declares for a hit (lowered here: a stored binary
        is served only as those)."""
        family = self.registry.get(res.artifact.kernel.family)
        return family.lower_id(res.artifact, self.device).kernel_names

    def _validate(self, art: Artifact, names: tuple[str, ...]) -> str:
        """Prove ``art`` (the node's book, else a child process): "" when it loads, else
        why."""
        prover = self.prover
        if prover is None:
            if self._own_prover is None:
                self._own_prover = Prover(self.device, ProofBook(None))
            prover = self._own_prover
        return prove_family(prover, art, names)

    def _load(self, binary: bytes, kernel_names: tuple[str, ...] = ()) -> LoadedBinary:
        """Load on this batch's device (LoadError when it refuses the binary)."""
        ctx, cl_device = self._context.get()
        return load_binary(ctx, cl_device, binary, kernel_names,
                           arch=self.device.native_arch)

    # -- bookkeeping ---------------------------------------------------------------------------
    def _done(self, res: KernelResult, outcome: Outcome, notify: Progress,
              loaded: LoadedBinary | None = None, lowered: Lowered | None = None) -> None:
        res.outcome = outcome
        if loaded is not None:
            res.native_fallback = loaded.fallback
            if self.keep_programs:
                res.program = loaded.program
        if self.recorder is not None and res.key is not None:
            self.recorder.compilation(
                Trip(family=res.artifact.kernel.family, key=res.key, outcome=outcome,
                     work_s=res.work_s, worker=res.worker, native_fallback=res.native_fallback,
                     kernel=res.label),
                lowered)
        notify(res)

    @staticmethod
    def _fail(res: KernelResult, kind: str, message: str, notify: Progress,
              build_log: str = "") -> None:
        res.failure = KernelFailure(kind=kind, message=message,
                                    build_log=build_log)
        notify(res)
