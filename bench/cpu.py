"""The CPU a benchmark ran on, for its report (one reader of /proc/cpuinfo for all)."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "?"
