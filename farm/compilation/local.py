"""The embedded default: local store and records in SQLite, compilation on a local
process pool on the local OpenCL device. The cluster swaps the store and the compiler;
the batch is the same code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from farm.compilation.batch import Batch
from farm.compilation.compiler import Compiler, InlineCompiler, ProcessPoolCompiler
from farm.compilation.proofs import ProofBook, Prover
from farm.core.device import DeviceContext, DeviceInfo, probe_devices
from farm.core.device_probe import choose_device
from farm.core.settings import Settings
from farm.families import Registry
from farm.records import Recorder
from farm.records.open import open_recorder
from farm.store import ArtifactStore
from farm.store.open import open_store


@dataclass
class LocalFarm:
    """Everything one embedded process uses, opened once and closed together."""

    settings: Settings
    registry: Registry
    device: DeviceInfo
    #: opened on first use: a build that finds every kernel stored needs no context
    context: DeviceContext
    store: ArtifactStore
    recorder: Recorder
    compiler: Compiler
    #: the proofs of stored binaries, with the node's book (farm.compilation.proofs)
    prover: Prover

    def batch(self, *, keep_programs: bool = False, label: str = "") -> Batch:
        batch = Batch(registry=self.registry, ctx=self.context,
                      store=self.store, compiler=self.compiler,
                      recorder=self.recorder, keep_programs=keep_programs, label=label)
        batch.prover = self.prover
        return batch


@contextlib.contextmanager
def local_farm(settings: Settings, *, label: str, workers: int | None = None,
               compiler: Compiler | None = None,
               registry: Registry | None = None) -> Iterator[LocalFarm]:
    """Open the embedded farm. ``workers=0`` compiles in this process; ``registry`` is the
    caller's when it already loaded the families (to expand a manifest)."""
    registry = registry if registry is not None else Registry.load(settings.family_modules)
    device = choose_device(settings, probe_devices())
    context = DeviceContext(device)
    store = open_store(settings)
    recorder = open_recorder(settings, label)
    n = settings.workers if workers is None else workers
    own: Compiler | None = None
    if compiler is None:
        own = (ProcessPoolCompiler(device, n, settings.native_binaries,
                                   crash_limit=settings.crash_limit,
                                   ready=settings.pocl_ready) if n > 0
               else InlineCompiler(*context.get(), settings.native_binaries,
                                   ready=settings.pocl_ready))
        compiler = own
    prover = Prover(device, ProofBook(settings.home))
    try:
        with recorder:  # an error or interrupt on its way out stays the one shown
            try:
                yield LocalFarm(settings=settings, registry=registry, device=device,
                                context=context, store=store, recorder=recorder,
                                compiler=compiler, prover=prover)
            finally:
                prover.close()
                if own is not None:
                    own.close()
    finally:
        store.close()
