"""The boundary between the farm and a family's own code (a plugin, for the most part).

A family's ``lower()`` and its parameter validators are code the operator installed,
run inside the farm's processes. Whatever they do, they fail *their kernel*, never the
build (issue 19 item 9):

* **Everything they raise is caught here**, ``BaseException`` included (``sys.exit``,
  a class of its own), except a person's Ctrl-C: it becomes a
  :class:`~farm.core.errors.PluginError` of that kernel.
* **Their time is bounded**: a plugin family's call runs on a daemon thread and is
  abandoned after :attr:`KernelFamily.time_limit_s` (at most :data:`MAX_SECONDS`),
  the thread asked to stop (an exception raised in it between two bytecodes) and left
  behind if it cannot (a daemon thread never keeps the process alive). The farm's own
  families run on the calling thread: a thread per call would cost more than their
  lowering. The threads are kept and reused (:class:`_Runner`): starting one cost
  about 0.1 ms, twice a kernel (its parameters, its ``lower()``), on every worker and
  client; an abandoned one is never used again.
* **What they return is validated again**: a ``Lowered`` made with ``model_construct``
  skipped validation (an integer source, ``options=None``); :func:`checked_lowered`
  validates it strictly before anything else sees it.
* **What they say is trimmed**: one line, control characters escaped, at most
  :data:`~farm.core.errors.MAX_ECHO` characters (:func:`~farm.core.errors.printable`).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, TypeVar

from pydantic import ValidationError

from farm.core.errors import FarmError, KernelError, PluginError, first_error, printable
from farm.core.model import Lowered

T = TypeVar("T")

#: the longest a family's call may take, whatever the family asks for
MAX_SECONDS = 60.0
#: the modules whose families are the farm's own (run on the calling thread)
_OWN = "farm.families.builtin"


class Family(Protocol):
    """What the boundary needs of a family: its name (its ``time_limit_s`` is read if it
    has one)."""

    @property
    def name(self) -> str: ...


class _Abandoned(BaseException):
    """Raised inside a plugin's thread that outlived its time (it should stop there)."""


def say(text: object) -> str:
    """A plugin's text as the farm repeats it: one line, escaped, bounded."""
    return printable(" ".join(str(text).split()))


def call(family: Family, what: str, fn: Callable[[], T]) -> T:
    """``fn()`` (code of ``family``): its result, or a :class:`PluginError` (or the
    :class:`FarmError` it raised on purpose, its message trimmed). ``pydantic``'s
    ``ValidationError`` passes through: it is the caller's to word."""
    if type(family).__module__.startswith(_OWN):
        return _guarded(family, what, fn)
    limit = min(MAX_SECONDS, max(0.1, float(getattr(family, "time_limit_s", MAX_SECONDS))))
    runner = _Runner.take()
    box = runner.run(lambda: _guarded(family, what, fn), limit)
    if box is None:
        runner.abandon()
        raise PluginError(f"family {say(family.name)}: {what} did not return within "
                          f"{limit:g} s (abandoned)")
    _Runner.give_back(runner)
    if "error" in box:
        raise box["error"]
    return box["value"]


class _Runner:
    """A daemon thread that runs plugin calls, one at a time, for whoever holds it; idle
    runners wait in a list (a process lowering on several threads holds several)."""

    _idle: ClassVar[list[_Runner]] = []
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._job: Callable[[], Any] | None = None
        self._box: dict[str, Any] = {}
        self._start = threading.Event()
        self._done = threading.Event()
        self._abandoned = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name="farm-family")
        self.thread.start()

    @classmethod
    def take(cls) -> _Runner:
        with cls._lock:
            if cls._idle:
                return cls._idle.pop()
        return cls()

    @classmethod
    def give_back(cls, runner: _Runner) -> None:
        with cls._lock:
            cls._idle.append(runner)

    def run(self, fn: Callable[[], Any], limit: float) -> dict[str, Any] | None:
        """``fn()``'s outcome (``value`` or ``error``), or ``None`` when it outlived
        ``limit`` seconds."""
        self._box = {}
        self._job = fn
        self._done.clear()
        self._start.set()
        return self._box if self._done.wait(limit) else None

    def abandon(self) -> None:
        """Ask the thread to stop (it is never given another call)."""
        self._abandoned = True
        _stop(self.thread)

    def _loop(self) -> None:
        try:
            while not self._abandoned:
                self._start.wait()
                self._start.clear()
                job, box = self._job, self._box
                try:
                    box["value"] = job() if job is not None else None
                except _Abandoned:
                    return
                except BaseException as exc:  # handed to the caller's thread
                    box["error"] = exc
                self._done.set()
        except _Abandoned:  # asked to stop just as its call returned
            return


def _forget_runners() -> None:
    """In a forked child: the parent's runner threads do not exist here."""
    _Runner._idle = []
    _Runner._lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_runners)


def _guarded(family: Family, what: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except (ValidationError, KeyboardInterrupt, _Abandoned):
        raise
    except FarmError as exc:  # raised on purpose, but its text is the plugin's
        exc.args = (say(exc) or f"family {say(family.name)}: {what} raised "
                                f"{type(exc).__name__}",)
        if isinstance(exc, KernelError):
            exc.build_log = printable(exc.build_log, 64 * 1024)
        raise
    except BaseException as exc:  # SystemExit, a class of its own: the kernel's failure
        raise PluginError(f"family {say(family.name)}: {what} raised "
                          f"{type(exc).__name__}: {say(exc)}") from None


def _stop(thread: threading.Thread) -> None:
    """Ask ``thread`` to stop: :class:`_Abandoned` is raised in it at its next bytecode
    (a thread blocked in C code stays blocked, a daemon that dies with the process)."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                   ctypes.py_object(_Abandoned))


def checked_lowered(family: Family, value: object) -> Lowered:
    """``value`` as a :class:`Lowered` that passed validation: ``lower()`` may return
    one built with ``model_construct`` (nothing checked) or something else entirely."""
    if not isinstance(value, Lowered):
        raise PluginError(f"family {say(family.name)}: lower() returned "
                          f"{type(value).__name__}, not Lowered")
    fields = {name: value.__dict__.get(name) for name in Lowered.model_fields}
    try:
        lowered = Lowered.model_validate(fields, strict=True)
    except ValidationError as exc:
        where, why = first_error(exc)
        raise PluginError(f"family {say(family.name)}: lower() returned a Lowered that "
                          f"does not validate: {where}: {why}") from None
    if not lowered.kernel_names:
        raise PluginError(f"family {say(family.name)}: lower() returned a Lowered that "
                          "does not validate: kernel_names: declares no kernel")
    return lowered
