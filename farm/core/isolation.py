"""Isolation of a measurement: while a process times kernels, nothing else on the host
compiles on the cores it measures, and nobody else measures on its device.

Why: on a CPU device (PoCL) the device *is* the host's cores. A compile of another pool
process, of a ``farm build`` next door or of the measuring process's own compile pool
takes cores away from the kernel being timed, and the timings (and the winner they
choose) then measure the compile, not the kernel (docs/TUNING.md has the figures). On a
GPU the kernel's time comes from the device's own events, and a host compile does not
move it; two measurements on one GPU still would.

How: two advisory file locks per *resource* (``flock``, so a process that dies lets go
of them with its file descriptors), in one host-wide folder:

* ``use-<resource>``: taken **shared** by every compile (:func:`compile_slot`, around the
  platform compiler in :func:`farm.compilation.finalize.finalize`), **exclusive** by a
  measurement (:meth:`HostLock.measuring`). A measurement therefore waits for the
  compiles under way to end, and none starts until it is done;
* ``gate-<resource>``: a turnstile that keeps a stream of compiles from starving a
  measurement (``flock`` has no queue: a waiting exclusive lock does not hold back new
  shared ones). A compile passes it (shared, for an instant) before it takes its slot;
  a measurement holds it exclusively from before it waits for the slots until it ends,
  so compiles that come meanwhile wait at the gate.

Resources: ``cpu`` for the host's cores (every compile takes a slot of it; a measurement
on a CPU device holds it), ``device-<fingerprint>-<index>`` for a GPU (measurements
only). So a pool that compiles and tunes on one host pauses its compiles while one of
its processes measures a CPU device, and serializes the measurements of one device,
without any message between the processes.

The folder is host-wide by construction: ``FARM_ISOLATION_DIR``, else
``<tmp>/kernel-farm-isolation-<uid>`` (per user: a lock another user could hold for ever
would stop every compile). It is read from the environment here, not from a
:class:`~farm.core.settings.Settings`, because compiles run where no settings are passed
(a compile pool's children, the program hook inside an application), and every process
of the host must find the same files; ``Settings.isolation_dir`` reads the same
variable. Waits are bounded (:data:`COMPILE_WAIT_S`, :data:`MEASURE_WAIT_S`): past them
the work goes on unisolated, with a warning, rather than hanging a build; a measurement
says so in its result (``isolated`` False).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from farm.core.device import DeviceInfo

log = logging.getLogger(__name__)

#: the variable naming the folder (Settings.isolation_dir reads it too)
ENV_VAR = "FARM_ISOLATION_DIR"
#: the resource of the host's cores
CPU = "cpu"
#: the longest a compile waits for a measurement to end before it compiles anyway
COMPILE_WAIT_S = 900.0
#: the longest a measurement waits for the compiles and measurements under way
MEASURE_WAIT_S = 900.0
_POLL_S = (0.002, 0.05)  # first and longest sleep between two tries
_RESOURCE = re.compile(r"[a-z0-9][a-z0-9-]{0,150}")

#: resources this process holds a measurement of (its own compiles skip the slot then:
#: a compile that waited for its own process's measurement would wait for ever)
_held: set[str] = set()
_held_lock = threading.Lock()


def default_folder() -> Path:
    """``FARM_ISOLATION_DIR``, else a folder of this user's in the temporary folder."""
    chosen = os.environ.get(ENV_VAR)
    if chosen:
        return Path(chosen)
    return Path(tempfile.gettempdir()) / f"kernel-farm-isolation-{os.getuid()}"


def lock_file(folder: Path, kind: str, resource: str) -> Path:
    """The file of one lock (``gate`` or ``use``) of ``resource``."""
    if kind not in ("gate", "use") or not _RESOURCE.fullmatch(resource):
        raise ValueError(f"not a lock: {kind} {resource!r:.80}")
    return folder / f"{kind}-{resource}.lock"


class _Flock:
    """One advisory lock on one file, through a descriptor of its own (so two threads of
    one process hold two locks, as two processes would)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
        self.fd = os.open(path, flags, 0o600)

    def take(self, shared: bool, deadline: float) -> bool:
        """Lock; ``False`` when ``deadline`` (monotonic) passed first."""
        op = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        sleep = _POLL_S[0]
        while True:
            try:
                fcntl.flock(self.fd, op)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                return False
            time.sleep(sleep)
            sleep = min(_POLL_S[1], sleep * 2)

    def close(self) -> None:
        os.close(self.fd)  # closing the descriptor releases its lock


class HostLock:
    """The locks of one folder (see the module docstring)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder if folder is not None else default_folder()

    def _locks(self, resource: str) -> tuple[_Flock, _Flock]:
        """``resource``'s turnstile and its lock of use (``OSError``: the folder is
        unusable)."""
        return (_Flock(lock_file(self.folder, "gate", resource)),
                _Flock(lock_file(self.folder, "use", resource)))

    @contextlib.contextmanager
    def compiling(self, wait_s: float = COMPILE_WAIT_S) -> Iterator[bool]:
        """A compile's slot of the host's cores; yields whether it was taken (``False``:
        the folder is unusable, or a measurement held it past ``wait_s``)."""
        with _held_lock:
            own = CPU in _held
        if own:  # this process measures: its own compile must not wait for itself
            yield False
            return
        try:
            gate, use = self._locks(CPU)
        except OSError as exc:
            log.warning("isolation: cannot use %s (%s); compiling without a slot",
                        self.folder, exc.strerror or exc)
            yield False
            return
        try:
            deadline = time.monotonic() + wait_s
            try:
                slot = gate.take(shared=True, deadline=deadline) and \
                    use.take(shared=True, deadline=deadline)
            finally:
                gate.close()  # the turnstile: passed in an instant
            if not slot:
                log.warning("isolation: a measurement held the host's cores for over "
                            "%.0f s; compiling anyway", wait_s)
            yield slot
        finally:
            use.close()

    @contextlib.contextmanager
    def measuring(self, resource: str, wait_s: float = MEASURE_WAIT_S) -> Iterator[bool]:
        """``resource`` to this process alone: no compile (for :data:`CPU`) and no other
        measurement of it meanwhile. Yields whether isolation holds (``False``: the
        folder is unusable, or the others held on past ``wait_s``: measured anyway)."""
        with _held_lock:
            if resource in _held:
                raise RuntimeError(f"isolation: {resource} is measured by this process "
                                   "already")
            _held.add(resource)
        try:
            try:
                gate, use = self._locks(resource)
            except OSError as exc:
                log.warning("isolation: cannot use %s (%s); measuring unisolated",
                            self.folder, exc.strerror or exc)
                yield False
                return
            try:
                deadline = time.monotonic() + wait_s
                held = gate.take(shared=False, deadline=deadline) and \
                    use.take(shared=False, deadline=deadline)
                if not held:
                    log.warning("isolation: %s stayed busy for over %.0f s; measuring "
                                "unisolated", resource, wait_s)
                yield held
            finally:
                use.close()
                gate.close()
        finally:
            with _held_lock:
                _held.discard(resource)


def resource_of(device: DeviceInfo) -> str:
    """What a measurement on ``device`` must have to itself: the host's cores for a CPU
    device (PoCL's CPU drivers), else that one device."""
    if device.compiles_at_launch or "cpu" in device.device_name.lower():
        return CPU
    return f"device-{device.fingerprint}-{device.platform_index}-{device.device_index}"


def compile_slot() -> contextlib.AbstractContextManager[bool]:
    """The slot a compile takes in the host-wide folder (:meth:`HostLock.compiling`)."""
    return HostLock().compiling()
