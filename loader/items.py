"""What a warm reports of each kernel (:class:`WarmItem`) and of each phase
(:class:`Phase`): shared by the warm (:mod:`loader.warming`) and the first launches after it
(:mod:`loader.readiness`), which the warm calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from farm.core.model import ArtifactId, KernelFailure, Key
from loader.programs import Source


@dataclass
class WarmItem:
    """One kernel of a warm: where it came from, or why it failed, and its times."""

    artifact: ArtifactId
    key: Key | None = None
    source: Source | None = None
    failure: KernelFailure | None = None
    fetch_s: float = 0.0
    load_s: float = 0.0
    work_s: float = 0.0
    #: why the artifact's machine code was refused and its portable binary loaded
    native_fallback: str = ""
    #: its declared launch, once, after the warm (``launch=True``; loader/readiness.py)
    first_launch_s: float | None = None

    @property
    def label(self) -> str:
        return self.artifact.kernel.label()


WarmProgress = Callable[[WarmItem], None]


@dataclass
class Phase:
    """A phase's wall-clock span (first start to last end; phases overlap when they run
    at once) and the summed time of its kernels (larger than the span on threads)."""

    wall_s: float = 0.0
    work_s: float = 0.0
    kernels: int = 0
    _first: float | None = field(default=None, repr=False)
    _last: float | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, start: float, end: float, work_s: float | None = None,
            kernels: int = 1) -> None:
        with self._lock:
            self._first = start if self._first is None else min(self._first, start)
            self._last = end if self._last is None else max(self._last, end)
            self.wall_s = self._last - self._first
            self.work_s += (end - start) if work_s is None else work_s
            self.kernels += kernels

    def summary(self) -> dict[str, float | int]:
        return {"wall_s": round(self.wall_s, 4), "work_s": round(self.work_s, 4),
                "kernels": self.kernels}
