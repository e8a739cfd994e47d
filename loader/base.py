"""What every way of asking a :class:`~loader.kernel_loader.KernelLoader` stands on: one
device and its context, memory, the store tiers, one trip, a batch of misses.

The warm of a whole manifest (:mod:`loader.warming`), the first launches
(:mod:`loader.readiness`) and the tuned winners (:mod:`loader.tuned`) are engines over a
:class:`LoaderBase`; :class:`~loader.kernel_loader.KernelLoader` adds them as methods. So
those engines import this module and nothing imports them back (no cycle).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

from pydantic import BaseModel

from farm.compilation.batch import Batch, BatchReport, Progress
from farm.compilation.compiler import Compiler, InlineCompiler, ProcessPoolCompiler
from farm.compilation.obtain import store_key
from farm.compilation.proofs import ProofBook, Prover, prove_family
from farm.core.device import DeviceContext, DeviceInfo, probe_devices
from farm.core.device_probe import choose_device
from farm.core.errors import KernelError, SettingsError
from farm.core.generation import bump_generation
from farm.core.keys import Namespace
from farm.core.model import Artifact, ArtifactId, Key, LaunchSettings, Variant
from farm.core.outcomes import Outcome
from farm.core.settings import Settings, load_settings
from farm.families import Registry
from farm.records import Recorder
from farm.records.model import Trip
from farm.records.open import open_recorder
from farm.store import ArtifactStore, open_store
from loader.errors import ArtifactMissing, UnknownKernelName, failure_error
from loader.programs import InFlight, LoadedProgram, source_of
from loader.tiers import Tier, TierFetcher

if TYPE_CHECKING:
    import pyopencl as cl

    from farm.cluster.client import ClusterClient

log = logging.getLogger(__name__)

OnMiss = Literal["compile", "farm", "fail"]


@dataclass
class LoaderStats:
    """Counters of what a loader did, for summaries and tests. Thread-safe increments.

    ``memory`` counts memory hits, ``joined`` waits on another thread's trip, ``local``
    and ``remote`` store hits loaded, ``compiled``/``rekeyed`` full misses obtained here,
    ``farm`` full misses obtained through the workers, ``loads`` programs this loader
    created from store binaries, ``native_fallbacks`` those of them whose machine code the
    device refused (their portable binary was loaded: see farm/compilation/native.py),
    ``validated`` imported binaries a child process loaded before this one did,
    ``quarantined`` stored binaries proven bad on this device (moved aside), ``failures``
    trips that raised.
    """

    memory: int = 0
    joined: int = 0
    local: int = 0
    remote: int = 0
    compiled: int = 0
    rekeyed: int = 0
    farm: int = 0
    loads: int = 0
    native_fallbacks: int = 0
    validated: int = 0
    quarantined: int = 0
    compiler_invocations: int = 0
    failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)
                    if not f.name.startswith("_")}


class LoaderBase:
    """A loader without its engines (:class:`~loader.kernel_loader.KernelLoader` is the
    one to use: its docstring says what the arguments mean)."""

    def __init__(self, settings: Settings | None = None, *,
                 device: str | DeviceInfo | DeviceContext | None = None,
                 on_miss: OnMiss = "compile", store: ArtifactStore | None = None,
                 registry: Registry | None = None, recorder: Recorder | None = None,
                 compiler: Compiler | None = None, label: str = "loader") -> None:

        if on_miss not in ("compile", "farm", "fail"):
            raise SettingsError(f"on_miss must be 'compile', 'farm' or 'fail', not {on_miss!r}")
        self.settings = settings if settings is not None else load_settings()
        if on_miss == "farm" and not self.settings.redis_url:
            raise SettingsError("on_miss='farm' needs the cluster: set FARM_REDIS_URL")
        self.on_miss: OnMiss = on_miss
        self.label = label
        self.stats = LoaderStats()
        self._owned = contextlib.ExitStack()
        self._lock = threading.Lock()
        #: programs in memory and trips in flight (shared with warm)
        self.inflight = InFlight()
        self._compiler = compiler
        self._owns_compiler = False
        self._cluster: ClusterClient | None = None
        self._prover: Prover | None = None
        self._closed = False
        try:
            if isinstance(device, DeviceContext):  # a caller started the context earlier
                self._device, self._context = device.info, device
            else:
                self._device = device if isinstance(device, DeviceInfo) else \
                    choose_device(self.settings, probe_devices(), device)
                # Created on a thread, first, while the families load, the store opens
                # and the look-ups run: a context costs up to seconds on a GPU, those none.
                self._context = DeviceContext(self._device).start()
            self._queue_made: cl.CommandQueue | None = None
            self.registry = registry if registry is not None else \
                Registry.load(self.settings.family_modules)
            self.namespace = Namespace.for_fingerprint(self._device.fingerprint)
            #: the store and recorder this loader opened itself (an environment switch
            #: replaces exactly these); injected ones belong to the caller
            self._owns_environment = store is None and recorder is None
            self._environment = contextlib.ExitStack()
            self._owned.callback(self._environment.close)
            if store is None:
                store = open_store(self.settings)
                self._environment.callback(store.close)
            self.store = store
            #: the store tiers, walked front to back (shared with warm)
            self.fetcher = TierFetcher(store, self.namespace, self._context, self.stats.bump,
                                       self.declared_names, self.validate_isolated)
            if not self.prover.book.holds(self._device.fingerprint):
                # a node that never proved a binary of this device will: its child opens
                # the device while this one does (farm.compilation.proofs)
                self.prover.start()
            if recorder is None:
                recorder = open_recorder(self.settings, label)
                self._environment.callback(recorder.close)
            self.recorder = recorder
        except BaseException:
            self._owned.close()
            raise

    def switch_environment(self, environment: str) -> None:
        """Serve from another named environment (``FARM_ENVIRONMENT``) from now on.

        Closes this environment's store and records session, opens the other's, and
        bumps the process-wide generation (:mod:`farm.core.generation`): this loader's memory
        and every other generation-bound cache in the process drop what they hold, so
        no program loaded from the old environment's store is served in the new one.
        A loader given its own ``store`` or ``recorder`` cannot switch (they are the
        caller's).
        """
        if not self._owns_environment:
            raise SettingsError("this loader was given its store or recorder; open a new "
                                "loader for another environment")
        settings = load_settings(**{**self.settings.model_dump(exclude_unset=True),
                                    "environment": environment})
        store = open_store(settings)
        try:
            recorder = open_recorder(settings, self.label)
        except BaseException:
            store.close()
            raise
        with self._lock:
            self._environment.close()
            self._environment = contextlib.ExitStack()
            self._environment.callback(store.close)
            self._environment.callback(recorder.close)
            self._owned.callback(self._environment.close)
            self.settings, self.store, self.recorder = settings, store, recorder
            self.fetcher = TierFetcher(store, self.namespace, self._context, self.stats.bump,
                                       self.declared_names, self.validate_isolated)
            bump_generation()

    # -- what an application uses ------------------------------------------------------
    @property
    def context(self) -> cl.Context:
        """The loader's OpenCL context: make buffers in it."""
        return self._context.ctx

    @property
    def queue(self) -> cl.CommandQueue:
        """An in-order command queue on the device, made with the context."""
        import pyopencl as cl

        with self._lock:
            if self._queue_made is None:
                self._queue_made = cl.CommandQueue(self._context.ctx, self._context.cl_device)
            return self._queue_made

    @property
    def context_ready(self) -> bool:
        """Whether the device's context exists yet (it is made on a thread at start)."""
        return self._context.opened

    @property
    def device(self) -> DeviceInfo:
        """The device, with its fingerprint and limits."""
        return self._device

    @property
    def cl_device(self) -> cl.Device:
        """The pyopencl device object."""
        return self._context.cl_device

    def artifact_id(self, family: str, params: Mapping[str, Any] | BaseModel | None = None,
                    *, launch: LaunchSettings | None = None,
                    variant: Variant | None = None) -> ArtifactId:
        """The artifact id of a family's kernel (validates the parameters)."""
        raw = params.model_dump(mode="json") if isinstance(params, BaseModel) else params
        return self.registry.get(family).artifact_id(raw or {}, launch, variant)

    def program(self, family: str, params: Mapping[str, Any] | BaseModel | None = None, *,
                launch: LaunchSettings | None = None,
                variant: Variant | None = None) -> cl.Program:
        """The loaded program of a family's kernel (shared; do not rebuild it)."""
        return self.program_for(self.artifact_id(family, params, launch=launch,
                                                 variant=variant))

    def kernel(self, family: str, params: Mapping[str, Any] | BaseModel | None = None, *,
               name: str | None = None, launch: LaunchSettings | None = None,
               variant: Variant | None = None) -> cl.Kernel:
        """A fresh ``pyopencl.Kernel`` of a family's kernel, ready to launch.

        ``name`` picks a kernel of a program that has several (default: its first).
        Raises a :class:`~farm.core.errors.KernelError` (with the build log) when the kernel
        cannot be obtained, :class:`ArtifactMissing` with ``on_miss="fail"``.
        """
        return self.kernel_for(self.artifact_id(family, params, launch=launch,
                                                variant=variant), name=name)

    def program_for(self, artifact: ArtifactId) -> cl.Program:
        """The loaded program of an artifact id."""
        return self._obtain(artifact).program

    def kernel_for(self, artifact: ArtifactId, *, name: str | None = None) -> cl.Kernel:
        """A fresh kernel of an artifact id (see :meth:`kernel`)."""
        import pyopencl as cl

        entry = self._obtain(artifact)
        if name is None:
            if not entry.kernel_names:
                raise UnknownKernelName(f"{artifact.kernel.label()}: the program has no "
                                        "kernels")
            name = entry.kernel_names[0]
        elif name not in entry.kernel_names:
            raise UnknownKernelName(f"{artifact.kernel.label()}: no kernel named {name!r}; "
                                    f"the program has {', '.join(entry.kernel_names)}")
        return cl.Kernel(entry.program, name)

    def cached(self, artifact: ArtifactId) -> bool:
        """Whether the artifact's program is in memory now (no trip needed)."""
        return self.inflight.get(InFlight.key(self.key_of(artifact))) is not None

    @property
    def tiers(self) -> list[Tier]:
        """The store tiers this loader walks, front to back."""
        return self.fetcher.tiers

    def close(self) -> None:
        """Close what the loader opened (store, recorder, compile processes). Idempotent.

        Programs and kernels already handed out stay usable while the application holds
        them; the context lives as long as they do.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._compiler is not None and self._owns_compiler:
                self._compiler.close()
        finally:
            self._owned.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KernelLoader(device={self._device.fingerprint}, on_miss={self.on_miss}, "
                f"store={self.store.location})")

    # -- one trip ------------------------------------------------------------------------
    def key_of(self, artifact: ArtifactId) -> Key:
        """The store key of an artifact id under this farm's code (its build id)."""
        return store_key(self.registry, artifact)

    def declared_names(self, artifact: ArtifactId) -> tuple[str, ...]:
        """The kernel names the family declares for ``artifact`` on this device: the
        only ones a stored binary served for it may hold (lowering costs tens of
        microseconds, against a millisecond or more for the load it guards)."""
        family = self.registry.get(artifact.kernel.family)
        return family.lower_id(artifact, self._device).kernel_names

    @property
    def prover(self) -> Prover:
        """This loader's proofs: the node's book, and a child process for binaries this
        node has not proven (started on the first one, closed with the loader)."""
        with self._lock:
            if self._prover is None:
                self._prover = Prover(self._device, ProofBook(self.settings.home))
                self._owned.callback(self._prover.close)
            return self._prover

    def validate_isolated(self, art: Artifact, names: tuple[str, ...]) -> str:
        """Prove ``art`` on this node before it loads here: "" when it loads, else why."""
        return prove_family(self.prover, art, names)

    def _obtain(self, artifact: ArtifactId) -> LoadedProgram:
        """Memory, else a trip; concurrent asks for one key share one trip."""
        key = self.key_of(artifact)
        ck = InFlight.key(key)
        hit = self.inflight.get(ck)
        if hit is None:
            hit, fut, leader = self.inflight.lead(ck)
        if hit is not None:
            self.stats.bump("memory")
            return hit
        assert fut is not None
        if not leader:
            self.stats.bump("joined")
            return fut.result()
        try:
            entry = self._trip(artifact, key)
        except BaseException as exc:
            self.stats.bump("failures")
            self.inflight.settle(ck, fut, None, exc)
            raise
        self.inflight.settle(ck, fut, entry)
        return entry

    def _trip(self, artifact: ArtifactId, key: Key) -> LoadedProgram:
        start = time.perf_counter()
        found = self.fetcher.fetch_and_load(artifact, key)
        if found is not None:
            entry, tier = found
            self.stats.bump(tier.name)
            self.record_loaded(entry, time.perf_counter() - start, artifact.kernel.label())
            return entry
        label = artifact.kernel.label()
        if self.on_miss == "fail":
            raise ArtifactMissing(f"{artifact.describe()}: no store tier holds key {key} "
                                  f"for {self.namespace} (on_miss='fail')")
        if self.on_miss == "farm":
            report = self.farm_batch([artifact])
        else:
            report = self.compile_batch([artifact])
        res = report.results[0]
        if res.failure is not None:
            raise failure_error(label, res.failure)
        if self.on_miss == "farm":
            got = self.fetcher.fetch_and_load(artifact, key)
            if got is None:
                raise KernelError(f"{label}: the farm reported {res.outcome} but no store "
                                  "tier serves it to this device")
            self.stats.bump("farm")
            self.record_loaded(got[0], time.perf_counter() - start, artifact.kernel.label())
            return got[0]
        assert res.program is not None and res.outcome is not None
        self.stats.bump(source_of(res.outcome).value)
        return LoadedProgram.of(res.program, artifact.kernel.family, key)

    def record_loaded(self, entry: LoadedProgram, work_s: float, kernel: str = "") -> None:
        """``kernel``: its readable name, for `farm records` (``KernelId.label()``)."""
        self.recorder.compilation(Trip(family=entry.family, key=entry.key,
                                       outcome=Outcome.LOADED, work_s=work_s,
                                       native_fallback=entry.native_fallback, kernel=kernel))

    def compile_batch(self, artifacts: list[ArtifactId], progress: Progress | None = None,
                      label: str = "") -> BatchReport:
        """Full misses through the farm's batch (lower, rekey or compile, load, store
        after load) on this loader's context, keeping the programs."""
        batch = Batch(registry=self.registry, ctx=self._context, store=self.store,
                      compiler=self._compiler_for(len(artifacts)),
                      recorder=self.recorder, record_batch=False,
                      keep_programs=True, label=label or self.label)
        batch.prover = self.prover
        report = batch.run(artifacts, progress=progress)
        self.stats.bump("compiler_invocations", report.compiler_invocations)
        return report

    def farm_batch(self, artifacts: list[ArtifactId], progress: Progress | None = None,
                   label: str = "") -> BatchReport:
        """Full misses through the cluster's workers; they store, the caller loads.

        Fails fast with a :class:`~farm.core.errors.ClusterError` when no live worker serves
        this device's fingerprint (rather than waiting on a queue nobody reads). The
        workers record how they obtained each kernel; this process records its loads.
        """
        from farm.cluster.client import BuildOptions, ClusterClient

        with self._lock:
            if self._cluster is None:
                self._cluster = ClusterClient(self.settings, registry=self.registry,
                                              store=self.store)
                self._environment.callback(self._drop_cluster)
            client = self._cluster
        report = client.build(artifacts, BuildOptions(fingerprint=self._device.fingerprint,
                                                      label=label or self.label),
                              progress=progress)
        self.stats.bump("compiler_invocations", report.compiler_invocations)
        return report

    def _drop_cluster(self) -> None:
        """Close the cluster client with the environment whose store it asks."""
        client, self._cluster = self._cluster, None
        if client is not None:
            client.close()

    def _compiler_for(self, misses: int) -> Compiler:
        """The injected compiler, else compile processes for many misses (made once,
        kept), and the calling thread for one (a pool's start-up would cost more)."""
        if self._compiler is not None:
            return self._compiler
        workers = self.settings.workers
        if misses > 1 and workers > 1:
            with self._lock:
                if self._compiler is None:
                    pool = ProcessPoolCompiler(self._device, workers,
                                               self.settings.native_binaries,
                                               ready=self.settings.pocl_ready)
                    self._compiler = pool
                    self._owns_compiler = True
                return self._compiler
        return InlineCompiler(self._context.ctx, self._context.cl_device,
                              self.settings.native_binaries, ready=self.settings.pocl_ready)
