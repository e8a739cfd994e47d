"""Validation in an isolated process: load a binary the farm did not validate on this
fingerprint in a child, so that a binary that crashes the driver kills the child, not a
process that matters.

Why: PoCL (and any driver) trusts the bytes it parses; a truncated ``poclbin`` whose
digest is right (a damaged bundle, a copy from another prefix) dies with SIGSEGV inside
``clCreateProgramWithBinary``. The workers validate what they compile by a load in the
process that compiled it, before it is stored; bytes from outside (a bundle import,
another prefix) get the same check here, in a child that holds nothing else.

What the child does per binary, and nothing more: the architecture check, a load
(:func:`farm.compilation.load.load_binary`), and the kernel names the family declares
when the caller gives them. It runs no kernel. A child that dies is a verdict on the
binary it was loading ("crashed", with the signal); one that does not answer within
``timeout_s`` is killed ("did not finish"); the next binary gets a fresh child.

Protocol on the child's stdin/stdout: the device (a ``DeviceInfo`` JSON line), then per
binary a JSON line ``{"names": [...], "size": N}`` and N raw bytes; the child answers
``ready`` once, then one JSON line per binary, ``{"error": ""}`` when it loads.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import IO

from farm.core.device import DeviceInfo

log = logging.getLogger(__name__)

#: a load takes milliseconds (a PTX JIT tens); a context up to seconds on a GPU
DEFAULT_TIMEOUT_S = 120.0


class ValidatorError(Exception):
    """The child could not start (no such device here, a driver that will not open)."""


class IsolatedValidator:
    """One child process on ``device``, started on first use, used one binary at a time.

    Thread-safe (a lock serializes the calls). :meth:`validate` answers "" when the
    binary loads, else why not; :meth:`close` ends the child.
    """

    def __init__(self, device: DeviceInfo, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        #: children started (a crash costs one): for tests and summaries
        self.started = 0

    def validate(self, binary: bytes, kernel_names: tuple[str, ...] = ()) -> str:
        """"" when ``binary`` loads on the device in the child (holding exactly
        ``kernel_names`` when given), else one line saying why it does not."""
        with self._lock:
            child = self._start()
            assert child.stdin is not None and child.stdout is not None
            header = json.dumps({"names": list(kernel_names), "size": len(binary)})
            try:
                child.stdin.write(header.encode() + b"\n" + binary)
                child.stdin.flush()
            except OSError:  # the child died before it read it
                return self._died(child)
            line = _read_line(child.stdout, self.timeout_s)
            if line is None:
                self._stop(child)
                return f"loading it did not finish within {self.timeout_s:.0f} s"
            if not line:
                return self._died(child)
            try:
                answer = json.loads(line)
                return str(answer["error"])
            except (ValueError, KeyError, TypeError):
                self._stop(child)
                return "the validating process answered nonsense"

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._stop(self._child)

    def __enter__(self) -> IsolatedValidator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the child -------------------------------------------------------------------------
    def _start(self) -> subprocess.Popen[bytes]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        child = subprocess.Popen(
            [sys.executable, "-m", "farm.compilation.validate"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=os.environ.copy(), close_fds=True)
        self.started += 1
        assert child.stdin is not None and child.stdout is not None
        try:
            child.stdin.write(self.device.model_dump_json().encode() + b"\n")
            child.stdin.flush()
        except OSError:
            pass
        ready = _read_line(child.stdout, self.timeout_s)
        if ready != "ready":
            self._stop(child)
            why = ready or "it exited"
            raise ValidatorError(f"the validating process did not start on "
                                 f"{self.device.fingerprint}: {why}")
        self._child = child
        return child

    def _died(self, child: subprocess.Popen[bytes]) -> str:
        code = child.wait()
        self._child = None
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the driver crashed loading it ({name}, in the validating process)"
        return f"the validating process exited with status {code} loading it"

    def _stop(self, child: subprocess.Popen[bytes]) -> None:
        if child.poll() is None:
            child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        if self._child is child:
            self._child = None


def _read_line(stream: IO[bytes], timeout_s: float) -> str | None:
    """One line from ``stream``; "" at end of file; ``None`` past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            return stream.readline().decode("utf-8", "replace").strip()


def _serve() -> int:
    """The child: open the device, then load what comes until stdin closes."""
    from farm.compilation.load import load_binary
    from farm.core.device import open_device
    from farm.core.errors import FarmError

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    info = DeviceInfo.model_validate_json(stdin.readline())
    try:
        ctx, cl_device = open_device(info)
    except FarmError as exc:
        stdout.write(f"cannot open the device: {exc}\n".encode())
        stdout.flush()
        return 1
    stdout.write(b"ready\n")
    stdout.flush()
    while header := stdin.readline():
        request = json.loads(header)
        binary = stdin.read(int(request["size"]))
        try:
            load_binary(ctx, cl_device, binary, tuple(request["names"]),
                        arch=info.native_arch)
            error = ""
        except FarmError as exc:
            error = " ".join(str(exc).split())[:500]
        stdout.write(json.dumps({"error": error}).encode() + b"\n")
        stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
