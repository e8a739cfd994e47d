"""The local loader: kernels onto this machine's device from memory, the store tiers
(the environment's SQLite file, then MinIO) or, on a miss, a compile here or on the farm.

An application needs :class:`KernelLoader` (and perhaps :func:`warm`)::

    with KernelLoader() as loader:
        add = loader.kernel("elementwise_binary", {"op": "add"})
        add(loader.queue, (n,), None, x_buf, y_buf, out_buf, np.uint32(n))

``docs/LOADER.md`` has the whole example and the rules (tiers, threads, records).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from farm.core.lazy import lazy_exports

if TYPE_CHECKING:
    from loader.base import LoaderStats, OnMiss
    from loader.errors import ArtifactMissing, UnknownKernelName
    from loader.items import Phase, WarmItem, WarmProgress
    from loader.kernel_loader import KernelLoader, warm
    from loader.programs import LoadedProgram
    from loader.tiers import Tier
    from loader.warm import WarmReport

# Names are imported on first use (PEP 562), like the farm's own packages.
_WHERE = {
    **dict.fromkeys(("ArtifactMissing", "UnknownKernelName"), "loader.errors"),
    **dict.fromkeys(("LoaderStats", "OnMiss"), "loader.base"),
    **dict.fromkeys(("Phase", "WarmItem", "WarmProgress"), "loader.items"),
    **dict.fromkeys(("KernelLoader", "warm"), "loader.kernel_loader"),
    "LoadedProgram": "loader.programs",
    "Tier": "loader.tiers",
    "WarmReport": "loader.warm",
}


__getattr__ = lazy_exports(__name__, _WHERE)


__all__ = [
    "ArtifactMissing",
    "KernelLoader",
    "LoadedProgram",
    "LoaderStats",
    "OnMiss",
    "Phase",
    "Tier",
    "UnknownKernelName",
    "WarmItem",
    "WarmProgress",
    "WarmReport",
    "warm",
]
