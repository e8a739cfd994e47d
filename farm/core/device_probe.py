"""Whether each OpenCL device's compiler works: one trivial build per device fingerprint,
remembered.

Why: a device can be listed and still compile nothing. pyopencl's wheel brings PoCL 3.0
(LLVM 14), which refuses every source on an AMD Zen 5 CPU ("unknown target CPU
'generic'"); with Debian's PoCL installed beside it the machine lists two PoCLs, one of
which works. Taking the first one listed failed every kernel of a build, one line each.
So before the farm uses a device (:func:`choose_device`, :func:`farm.core.device.
select_device`) it has built :data:`PROBE_SOURCE` on it, and it never chooses a device
whose build failed.

Cost: the outcome is kept per fingerprint, which names the driver and its version (a new
driver is a new fingerprint, probed again), in ``FARM_DEVICE_PROBES`` (default
``~/.cache/kernel-farm/device-probes``: it describes the machine's drivers, so every
FARM_HOME and environment shares it); a later start reads one small file a device. A
probe runs in a short-lived child process per device, all at once, so that the caller
keeps no OpenCL state (ARCHITECTURE: "OpenCL state never crosses a fork") and a compiler
that crashes harms nobody, with the drivers' own caches off, so the compiler really runs.

What is kept is what the compiler said: it built, or its first error line. A probe that
crashed, hung or could not open its device is said for this run and tried again at the
next start. ``farm devices --probe`` probes again whatever is kept (after changing a
driver's own settings, which its fingerprint does not show).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from farm.core.device import (
    DeviceInfo,
    ProbeResult,
    cannot_compile,
    open_device,
    select_device,
)
from farm.core.errors import FarmError, first_error_line, one_line

if TYPE_CHECKING:
    from farm.core.settings import Settings

log = logging.getLogger(__name__)

#: the trivial program: any compiler that works builds it
PROBE_SOURCE = "__kernel void farm_probe(__global int *out) { out[get_global_id(0)] = 1; }"
#: the probe's own version: a kept outcome of another version is probed again
PROBE_VERSION = 1
#: seconds a probe may take (a trivial build takes well under one)
PROBE_TIMEOUT_S = 120.0
#: the largest file of a kept outcome that is read (one is about 200 bytes)
_MAX_FILE = 65_536
#: a fingerprint as the farm makes them: the file name of its kept outcome
_FINGERPRINT = re.compile(r"[a-z0-9][a-z0-9-]{0,127}")
#: the drivers' own caches off in a probe: a cached binary would hide a broken compiler
_NO_CACHES = {"POCL_KERNEL_CACHE": "0", "PYOPENCL_NO_CACHE": "1", "CUDA_CACHE_DISABLE": "1"}


class _Kept(BaseModel):
    """One device's kept outcome, as its file holds it."""

    model_config = ConfigDict(extra="forbid")

    probe: int
    fingerprint: str
    usable: bool
    reason: str = Field(default="", max_length=1000)


@dataclass(frozen=True)
class Probed:
    """A probe's outcome, and whether it is the compiler's word (kept) or an accident of
    this run (a crash, a hang, a device that could not be opened: not kept)."""

    result: ProbeResult
    keep: bool


#: probes the given devices (the seam tests fake): fingerprint -> outcome
Runner = Callable[[Sequence[DeviceInfo]], dict[str, Probed]]


def probe_builds(devices: Sequence[DeviceInfo], folder: Path, *, again: bool = False,
                 run: Runner | None = None) -> dict[str, ProbeResult]:
    """Each device's probe outcome by fingerprint: kept ones read from ``folder``, the
    others (all of them with ``again``) probed now by ``run`` (default: a child process
    per device) and kept there."""
    results: dict[str, ProbeResult] = {}
    missing: dict[str, DeviceInfo] = {}
    for dev in devices:
        fp = dev.fingerprint
        if fp in results or fp in missing:
            continue
        kept = None if again else _read(folder, fp)
        if kept is not None:
            results[fp] = kept
        else:
            missing[fp] = dev
    if missing:
        for fp, probed in (run or probe_in_children)(list(missing.values())).items():
            results[fp] = probed.result.model_copy(update={"fresh": True})
            if probed.keep:
                _write(folder, fp, probed.result)
    return results


def choose_device(settings: Settings, devices: list[DeviceInfo],
                  selector: str | None = None) -> DeviceInfo:
    """The device this process uses: :func:`~farm.core.device.select_device` by
    ``selector`` (default ``FARM_DEVICE``) among ``devices``, knowing whose compiler
    works. A device found unusable just now is said once, in one line."""
    probes = probe_builds(devices, settings.device_probes)
    chosen = select_device(devices, selector or settings.device, probes)
    for dev in {d.fingerprint: d for d in devices}.values():
        probe = probes.get(dev.fingerprint)
        if probe is not None and probe.fresh and not probe.usable:
            log.warning("device %s cannot compile, so the farm does not use it",
                        cannot_compile(dev, probes))
    return chosen


def probe_in_children(devices: Sequence[DeviceInfo],
                      timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Probed]:
    """Probe each device in a child process of its own, all at once."""
    import time

    env = {**os.environ, **_NO_CACHES}
    children = {
        dev.fingerprint: subprocess.Popen(
            [sys.executable, "-c", "from farm.core.device_probe import _main; _main()",
             dev.model_dump_json()],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env)
        for dev in devices}
    deadline = time.monotonic() + timeout_s
    out: dict[str, Probed] = {}
    for fp, child in children.items():
        try:
            stdout, stderr = child.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            out[fp] = _accident(f"the probe build did not finish within {timeout_s:.0f} s")
            continue
        out[fp] = _answer(child.returncode, stdout, stderr)
    return out


def _answer(returncode: int, stdout: str, stderr: str) -> Probed:
    """A probe child's outcome from how it ended and what it printed."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return _accident(f"the probe build crashed its process ({name})")
    if returncode != 0:
        last = (stderr.strip().splitlines() or [f"exit status {returncode}"])[-1]
        return _accident(f"the probe could not run: {last[:300]}")
    try:
        return Probed(ProbeResult.model_validate_json(
            (stdout.strip().splitlines() or [""])[-1]), keep=True)
    except ValidationError:
        return _accident("the probe answered nothing readable")


def _accident(reason: str) -> Probed:
    return Probed(ProbeResult(usable=False, reason=reason), keep=False)


def probe_build(info: DeviceInfo) -> ProbeResult:
    """Build :data:`PROBE_SOURCE` on ``info``'s device in this process (the child's
    work): usable, or the compiler's first error line."""
    import pyopencl as cl

    ctx, dev = open_device(info)
    program = cl.Program(ctx, PROBE_SOURCE)
    try:
        program.build()
    except cl.Error as exc:
        try:
            build_log = str(program.get_build_info(dev, cl.program_build_info.LOG))
        except cl.Error:
            build_log = ""
        return ProbeResult(usable=False, reason=first_error_line(build_log.strip() or str(exc)))
    return ProbeResult(usable=True)


def _path(folder: Path, fingerprint: str) -> Path | None:
    return folder / f"{fingerprint}.json" if _FINGERPRINT.fullmatch(fingerprint) else None


def _read(folder: Path, fingerprint: str) -> ProbeResult | None:
    """The kept outcome, or None when there is none usable (missing, unreadable,
    malformed, another probe version or another fingerprint's): then it is probed."""
    path = _path(folder, fingerprint)
    if path is None:
        return None
    try:
        with path.open("rb") as fh:
            text = fh.read(_MAX_FILE + 1)
        if len(text) > _MAX_FILE:
            return None
        kept = _Kept.model_validate_json(text)
    except (OSError, ValidationError):
        return None
    if kept.probe != PROBE_VERSION or kept.fingerprint != fingerprint:
        return None
    return ProbeResult(usable=kept.usable, reason=kept.reason)


def _write(folder: Path, fingerprint: str, result: ProbeResult) -> None:
    """Keep ``result`` (whole or not at all: a temporary file renamed over the old one);
    a folder that cannot be written costs a probe at the next start, nothing else."""
    path = _path(folder, fingerprint)
    if path is None:
        return
    kept = _Kept(probe=PROBE_VERSION, fingerprint=fingerprint, usable=result.usable,
                 reason=result.reason[:1000])
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(kept.model_dump_json())
            os.replace(tmp, path)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.debug("device probe of %s not kept in %s: %s", fingerprint, folder, exc)


def _main() -> None:
    try:
        result = probe_build(DeviceInfo.model_validate_json(sys.argv[1]))
    except FarmError as exc:  # the device is not here (any more): no compiler's word
        print(one_line(exc), file=sys.stderr)
        raise SystemExit(3) from None
    print(result.model_dump_json())


if __name__ == "__main__":
    _main()
