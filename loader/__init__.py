"""The local loader: kernels onto this machine's device from memory, the store tiers
(the environment's SQLite file, then MinIO) or, on a miss, a compile here or on the farm.

An application needs :class:`KernelLoader` (and perhaps :func:`warm`)::

    with KernelLoader() as loader:
        add = loader.kernel("elementwise_binary", {"op": "add"})
        add(loader.queue, (n,), None, x_buf, y_buf, out_buf, np.uint32(n))

``docs/LOADER.md`` has the whole example and the rules (tiers, threads, records).
"""

# ruff: noqa: F401 - the TYPE_CHECKING block is the list of public names (farm.core.lazy)
from __future__ import annotations

from typing import TYPE_CHECKING

from farm.core.lazy import public_names

# The public names, imported on first use (PEP 562), like the farm's own packages: this
# block is their one list (farm.core.lazy reads it).
if TYPE_CHECKING:
    from loader.base import LoaderStats, OnMiss
    from loader.errors import ArtifactMissing, UnknownKernelName
    from loader.items import Phase, WarmItem, WarmProgress
    from loader.kernel_loader import KernelLoader, warm
    from loader.programs import LoadedProgram
    from loader.tiers import Tier
    from loader.warming import WarmReport

__getattr__, __dir__ = public_names(__name__)
