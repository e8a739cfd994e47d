"""``KernelLoader``: what an application uses to get a ready ``pyopencl.Kernel``.

One loader holds one OpenCL context on one device and serves kernels from, in order:

1. **memory**: programs this loader already loaded, in a
   :class:`~farm.core.generation.GenerationCache` keyed by (generation, key). It keeps the
   *program*, not the artifact's bytes: a loaded program is all a kernel needs, and the
   binary would only double the memory. A generation bump (environment switch) empties
   it, so nothing loaded from the old environment's store is served afterwards;
2. **the store tiers**, front to back (:func:`farm.store.open_store`: the environment's
   SQLite file, then MinIO when ``FARM_MINIO_ENDPOINT`` is set). Every tier verifies the
   digest; a binary the device refuses is a miss. A hit in a later tier is copied into
   the earlier ones *after* it loaded, so the next process on this machine needs no
   network, and a binary this device refused is never copied;
3. **a full miss**: ``on_miss="compile"`` (default) runs the farm's batch here (lower,
   rekey or compile, load, store after the load), ``on_miss="farm"`` asks the cluster's
   workers (:class:`farm.cluster.client.ClusterClient`) and then loads what they stored, and
   ``on_miss="fail"`` raises :class:`ArtifactMissing`.

Every trip that is not a memory hit is recorded (Loaded, Compiled or Rekeyed); a trip
that fails records nothing and raises a :class:`~farm.core.errors.FarmError` (a
``KernelError`` with the build log for a kernel that cannot be obtained).

**Threads.** A loader may be shared by threads; a kernel asked for by several at once is
fetched and loaded once (the others wait on the first one's trip). :meth:`kernel` returns
a *fresh* ``pyopencl.Kernel`` on every call, because a kernel's arguments are state that
two threads would race on; making one costs about 0.2 ms (pyopencl's argument code), so
keep the kernel you got for a hot loop rather than asking again per launch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.core.model import ArtifactId, LaunchSettings, Variant
from loader.base import LoaderBase, OnMiss

if TYPE_CHECKING:
    from farm.core.device import DeviceInfo
    from farm.core.settings import Settings
    from farm.manifest import Manifest
    from loader.tuned import Tuned, TuneOnMiss, Tunings
    from loader.warming import WarmProgress, WarmReport


class KernelLoader(LoaderBase):
    """Kernels on one OpenCL device, from memory, the store tiers, or a compile.

    ``settings`` default to the ``FARM_*`` environment. ``device`` picks the device by
    fingerprint, fingerprint prefix or name substring (default: ``settings.device``, else
    the first device whose compiler works: :func:`farm.core.device.select_device`), or
    is a :class:`~farm.core.device.DeviceInfo`, or a
    :class:`~farm.core.device.DeviceContext` a caller already started (its device and
    context are then the loader's). ``store``, ``registry``, ``recorder`` and
    ``compiler`` replace what the settings would open (the loader then does not close
    them). Use it as a context manager, or call :meth:`close`.

    The machinery is :class:`~loader.base.LoaderBase`'s; the engines over it are
    imported when first used (the tuning code only by a loader that asks for a tuned
    kernel).
    """

    _tunings: Tunings | None = None  # made on first use

    def tuned(self, family: str, problem: Mapping[str, Any], *,
              candidates: Sequence[Mapping[str, Any]] | None = None,
              launch: LaunchSettings | None = None, variant: Variant | None = None,
              on_miss: TuneOnMiss | None = None) -> Tuned:
        """The winner of ``problem``'s tuning here, loaded (``.kernel``, ``.params``),
        never timed here; ``on_miss`` (``first``, ``tune``, ``fail``): loader/tuned.py."""
        from loader import tuned

        with self._lock:
            self._tunings = self._tunings or tuned.Tunings(self)
        return self._tunings.tuned(family, problem, candidates=candidates, launch=launch,
                                   variant=variant, on_miss=on_miss)

    def warm(self, manifest: Manifest | str | Path | Iterable[ArtifactId], *,
             progress: WarmProgress | None = None, threads: int | None = None,
             label: str | None = None, launch: bool = False) -> WarmReport:
        """Obtain every kernel of a manifest now (see :func:`loader.warm`); ``launch``:
        then launch each once (the readiness figure, loader/readiness.py)."""
        from loader.warming import warm_loader

        return warm_loader(self, manifest, progress=progress, threads=threads, label=label,
                           launch=launch)


def warm(manifest: Manifest | str | Path | Iterable[ArtifactId], *,
         loader: KernelLoader | None = None, settings: Settings | None = None,
         device: str | DeviceInfo | None = None, on_miss: OnMiss = "compile",
         progress: WarmProgress | None = None, threads: int | None = None,
         label: str | None = None) -> WarmReport:
    """Obtain every kernel of ``manifest`` on the device (see :mod:`loader.warming`).

    With ``loader`` the programs stay in that loader's memory. Without one, a loader is
    opened for the call and closed after it: what remains is the local tier, filled with
    everything that was fetched or compiled, so the application's own loader later
    loads without network or compiler. The readiness figure (each kernel launched once,
    loader/readiness.py) is :meth:`KernelLoader.warm`'s ``launch``.
    """
    from loader.warming import warm_loader

    if loader is not None:
        return warm_loader(loader, manifest, progress=progress, threads=threads, label=label)
    with KernelLoader(settings, device=device, on_miss=on_miss, label="warm") as own:
        return warm_loader(own, manifest, progress=progress, threads=threads, label=label)
