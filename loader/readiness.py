"""The readiness figure: time to first result per kernel, load plus first launch.

A load that returns in a millisecond is not what a user waits for when the driver
compiles again at the kernel's first launch (PoCL did, 100 to 400 ms a kernel, before
its artifacts carried their launch's machine code: docs/LOADER.md). So a warm can launch
every kernel it obtained once, right after, and report that launch beside the load.

The launch is the kernel's declared one (:meth:`KernelFamily.ready_launch`, the family's
example without its data): zero-filled buffers of its sizes, one work-group where that
runs the same machine code (:func:`farm.compilation.ready.launch`). Its time counts
making the ``pyopencl.Kernel`` and the launch to completion, not the buffers. In the
loader's own process this also leaves each kernel truly warm: a driver that makes code at
first launch has made it, so the application's first launch costs what its second does.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from farm.compilation.ready import launch
from farm.core.errors import FarmError
from farm.core.model import Key, ReadyLaunch
from loader.programs import Source

if TYPE_CHECKING:
    from loader.base import LoaderBase
    from loader.items import Phase, WarmItem

log = logging.getLogger(__name__)

#: where a warm item came from when its load is one of the kind the figure is about
LOADED = (Source.LOCAL, Source.REMOTE, Source.FARM)


def launch_all(loader: LoaderBase, items: list[WarmItem], phase: Phase,
               notify: Callable[[WarmItem], None] | None = None) -> None:
    """Launch each obtained kernel of ``items`` once, one after the other (a launch uses
    every core of a CPU device), and set its ``first_launch_s``; items of one key share
    the launch. A kernel without a declared launch, or whose launch fails, keeps
    ``None`` (the failure is logged: a warm never fails on it)."""
    done: dict[Key | None, float | None] = {}
    for item in items:
        if item.source is None or item.failure is not None:
            continue
        if item.key not in done:
            start = time.perf_counter()
            done[item.key] = _first_launch(loader, item)
            phase.add(start, time.perf_counter())
        item.first_launch_s = done[item.key]
        if notify is not None:
            notify(item)


def _first_launch(loader: LoaderBase, item: WarmItem) -> float | None:
    artifact = item.artifact
    try:
        family = loader.registry.get(artifact.kernel.family)
        ready = family.ready_launch(family.validate(artifact.kernel.params),
                                    artifact.kernel.launch)
    except Exception as exc:  # a plugin's example: no figure for it, not a failure
        log.info("%s: no declared launch (%s)", item.label, exc)
        return None
    if not isinstance(ready, ReadyLaunch):
        return None
    import pyopencl as cl

    try:
        start = time.perf_counter()
        kernel = loader.kernel_for(artifact, name=ready.kernel_name)
        made = time.perf_counter() - start
        return made + launch(loader.queue, kernel, ready)
    except (cl.Error, FarmError, ValueError, TypeError) as exc:
        log.warning("%s: its declared launch failed (%s)", item.label, exc)
        return None


def summary(items: list[WarmItem]) -> dict[str, float | int]:
    """Medians over the kernels loaded from a store tier and launched: the load alone,
    the first launch, and the two together (time to first result)."""
    seen: set[Key | None] = set()
    loads, firsts, results = [], [], []
    for item in items:
        if item.source not in LOADED or item.first_launch_s is None or item.key in seen:
            continue
        seen.add(item.key)
        loads.append(item.load_s)
        firsts.append(item.first_launch_s)
        results.append(item.load_s + item.first_launch_s)
    if not results:
        return {"kernels": 0}
    return {"kernels": len(results),
            "load_ms": round(1000 * statistics.median(loads), 3),
            "first_launch_ms": round(1000 * statistics.median(firsts), 3),
            "first_result_ms": round(1000 * statistics.median(results), 3),
            "first_result_s": round(sum(results), 4)}
