"""Validation in an isolated process: load a stored binary in a child, so that a binary
that crashes the driver kills the child, not a process that matters.

Why: PoCL (and any driver) trusts the bytes it parses; a truncated ``poclbin`` whose
digest is right (a damaged bundle, a copy from another prefix) dies with SIGSEGV inside
``clCreateProgramWithBinary``, one flipped bit aborts inside LLVM. Every stored binary is
proven here before its first use on a node (:mod:`farm.compilation.proofs`).

The child's driver cache is **private**: ``POCL_CACHE_DIR``, ``CUDA_CACHE_PATH`` and
``XDG_CACHE_HOME`` point into a temporary folder made for each child and removed when it
ends. A load the driver dies in leaves its half-written files there, never in the node's
own cache, where every later process would trip on them.

What the child does per binary, as its :class:`Request` says, and nothing more: the
architecture check and a load (:func:`farm.compilation.load.load_binary`); the exact
kernel names; for each work-group function the request names, the file PoCL unpacked
from the binary into the private cache is ``dlopen``\\ ed and its symbol looked up (what
PoCL does at a launch); and the recorded launch, where there is one
(:func:`farm.compilation.ready.launch`, on zero-filled buffers). A child that dies is a
verdict on the binary it was loading ("crashed", with the signal); one that does not
answer within ``timeout_s`` is killed and decides nothing; the next binary gets a fresh
child and a fresh cache folder.

Protocol on the child's stdin/stdout: the device (a ``DeviceInfo`` JSON line), then per
binary a JSON line (the request and ``"size": N``) and N raw bytes; the child answers
``ready`` once, then one JSON line per binary, ``{"error": ""}`` when it loads.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import IO, TYPE_CHECKING, Any

from farm.compilation.verdict import Verdict
from farm.core.device import DeviceInfo
from farm.core.runenv import unserved_environment

if TYPE_CHECKING:
    import pyopencl as cl

log = logging.getLogger(__name__)

#: a load takes milliseconds (a PTX JIT tens); a context up to seconds on a GPU
DEFAULT_TIMEOUT_S = 120.0


def private_caches(folder: str) -> dict[str, str]:
    """The environment of a process that proves binaries: every driver cache in
    ``folder`` (made for that process, removed with it), so that what a load the driver
    dies in leaves behind never reaches the node's own caches. Made here."""
    out = {"POCL_CACHE_DIR": os.path.join(folder, "pocl"),
           "CUDA_CACHE_PATH": os.path.join(folder, "cuda"),
           "XDG_CACHE_HOME": os.path.join(folder, "xdg"), "PYOPENCL_NO_CACHE": "1"}
    for key in ("POCL_CACHE_DIR", "CUDA_CACHE_PATH", "XDG_CACHE_HOME"):
        os.makedirs(out[key], exist_ok=True)
    return out


class ValidatorError(Exception):
    """The child could not start (no such device here, a driver that will not open)."""


@dataclass(frozen=True)
class Request:
    """What the child checks of one binary."""

    #: the exact kernel names (``None``: any)
    names: tuple[str, ...] | None = None
    #: a binary without kernels is refused (a family's); an application's may hold none
    require_kernel: bool = True
    #: (kernel, specialisation) of each work-group function to ``dlopen`` (PoCL)
    functions: tuple[tuple[str, str], ...] = ()
    #: recorded launches (``ReadyLaunch`` as JSON data), each run once
    launches: tuple[dict[str, Any], ...] = ()


class IsolatedValidator:
    """One child process on ``device``, started on first use (or by :meth:`start`), used
    one binary at a time. Thread-safe; :meth:`close` ends the child.

    ``module`` is what the child runs (``python -m``; another module's child serves its
    own requests through :func:`serve`), ``child_env`` what its environment adds."""

    module = "farm.compilation.validate"

    def __init__(self, device: DeviceInfo, timeout_s: float = DEFAULT_TIMEOUT_S,
                 child_env: dict[str, str] | None = None) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self.child_env = dict(child_env or {})
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._cache: str | None = None
        #: children started (a crash costs one): for tests and summaries
        self.started = 0

    def start(self) -> None:
        """Start the child without waiting for it to open the device."""
        with self._lock:
            self._spawn()

    def validate(self, binary: bytes, kernel_names: tuple[str, ...] = ()) -> str:
        """"" when ``binary`` loads on the device in the child (holding exactly
        ``kernel_names`` when given), else one line saying why it does not."""
        return self.check(binary, Request(names=kernel_names or None)).why

    def check(self, binary: bytes, request: Request) -> Verdict:
        """The child's verdict on ``binary`` under ``request``; :class:`ValidatorError`
        when no child can start here."""
        answer = self.exchange({**asdict(request)}, binary, self.timeout_s)
        if isinstance(answer, Verdict):
            return answer
        return Verdict(str(answer["error"]))

    def exchange(self, request: dict[str, Any], binary: bytes, timeout_s: float
                 ) -> dict[str, Any] | Verdict:
        """Send ``request`` and ``binary`` to the child; its answer (a JSON object), or
        the verdict of a child that died, answered nonsense or took longer than
        ``timeout_s`` (then killed); :class:`ValidatorError` when no child can start."""
        with self._lock:
            child = self._started()
            assert child.stdin is not None and child.stdout is not None
            header = json.dumps({**request, "size": len(binary)})
            try:
                child.stdin.write(header.encode() + b"\n" + binary)
                child.stdin.flush()
            except OSError:  # the child died before it read it
                return self._died(child)
            line = _read_line(child.stdout, timeout_s)
            if line is None:
                self._stop(child)
                return Verdict(f"loading it did not finish within {timeout_s:.0f} s",
                               definite=False)
            if not line:
                return self._died(child)
            try:
                answer = json.loads(line)
                if isinstance(answer, dict) and isinstance(answer.get("error"), str):
                    return answer
            except ValueError:
                pass
            self._stop(child)
            return Verdict("the validating process answered nonsense")

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._stop(self._child)

    def __enter__(self) -> IsolatedValidator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the child -------------------------------------------------------------------------
    def _spawn(self) -> subprocess.Popen[bytes]:
        """The child, started if there is none (not waited for)."""
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._cache = tempfile.mkdtemp(prefix="farm-validate-")
        env = {**unserved_environment(), **private_caches(self._cache), **self.child_env}
        child = subprocess.Popen(
            [sys.executable, "-m", self.module],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=env, close_fds=True)
        self.started += 1
        self._child, self._ready = child, False
        assert child.stdin is not None
        try:
            child.stdin.write(self.device.model_dump_json().encode() + b"\n")
            child.stdin.flush()
        except OSError:
            pass
        return child

    def _started(self) -> subprocess.Popen[bytes]:
        """The child, started and ready; :class:`ValidatorError` when it cannot be."""
        child = self._spawn()
        if self._ready:
            return child
        assert child.stdout is not None
        ready = _read_line(child.stdout, self.timeout_s)
        if ready != "ready":
            self._stop(child)
            why = ready or "it exited"
            raise ValidatorError(f"the validating process did not start on "
                                 f"{self.device.fingerprint}: {why}")
        self._ready = True
        return child

    def _died(self, child: subprocess.Popen[bytes]) -> Verdict:
        code = child.wait()
        self._stop(child)
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return Verdict(f"the driver crashed loading it ({name}, in the validating "
                           "process)")
        return Verdict(f"the validating process exited with status {code} loading it")

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
            self._child, self._ready = None, False
            if self._cache is not None:  # what a crashed load left goes with it
                shutil.rmtree(self._cache, ignore_errors=True)
                self._cache = None


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


#: what a child does with one binary: (context, device, its info, the bytes, the request)
#: -> the answer (a JSON object; ``error`` "" when all went well)
Handler = Callable[["cl.Context", "cl.Device", DeviceInfo, bytes, dict[str, Any]],
                   dict[str, Any]]


def _answer_check(ctx: cl.Context, cl_device: cl.Device, info: DeviceInfo, binary: bytes,
                  request: dict[str, Any]) -> dict[str, Any]:
    error = check_binary(ctx, cl_device, info.native_arch, binary, request)
    return {"error": " ".join(error.split())[:500]}


def serve(handler: Handler = _answer_check) -> int:
    """The child: open the device, then answer what comes until stdin closes."""
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
        stdout.write(json.dumps(handler(ctx, cl_device, info, binary, request)).encode()
                     + b"\n")
        stdout.flush()
    return 0


def check_binary(ctx: cl.Context, cl_device: cl.Device, arch: str, binary: bytes,
                 request: dict[str, Any]) -> str:
    """"" when ``binary`` passes every check of ``request`` here (``arch``: the device's
    native architecture), else why not. Run only where a crash harms nobody: the child,
    or a prover that is itself one (:mod:`farm.programs.ahead`)."""
    import pyopencl as cl

    from farm.compilation.load import load_binary
    from farm.core.errors import FarmError

    names = request.get("names")
    try:
        loaded = load_binary(ctx, cl_device, binary,
                             tuple(names) if names is not None else (),
                             arch=arch,
                             require_kernel=bool(request.get("require_kernel", True)))
    except FarmError as exc:
        return str(exc)
    if names is not None and sorted(loaded.names) != sorted(names):
        return (f"the binary holds kernels {', '.join(loaded.names) or 'none'}, its record "
                f"says {', '.join(names) or 'none'}")
    for kernel, spec in request.get("functions") or ():
        why = _opens(binary, kernel, spec)
        if why:
            return why
    for launch in request.get("launches") or ():
        from farm.compilation.ready import launch as run_launch
        from farm.core.model import ReadyLaunch

        try:
            ready = ReadyLaunch.model_validate(launch)
            run_launch(cl.CommandQueue(ctx, cl_device),
                       cl.Kernel(loaded.program, ready.kernel_name), ready, one_group=False)
        except (cl.Error, ValueError, TypeError) as exc:
            return f"its recorded launch failed: {exc}"
    return ""


def _opens(binary: bytes, kernel: str, spec: str) -> str:
    """"" when the work-group function ``kernel``/``spec`` that PoCL unpacked from
    ``binary`` into this child's cache opens and exports its symbol, as at a launch."""
    import ctypes

    from farm.compilation.elfstub import workgroup_symbol
    from farm.compilation.poclbin import PoclBinaryError, build_hash
    from farm.compilation.poclcache import loaded_folder

    try:
        folder = loaded_folder(build_hash(binary))
    except PoclBinaryError as exc:
        return str(exc)
    path = folder / kernel / spec / f"{kernel}.so" if folder is not None else None
    if path is None or not path.is_file():
        return f"work-group function {kernel}/{spec} was not unpacked from the binary"
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        getattr(lib, workgroup_symbol(kernel))
    except (OSError, AttributeError) as exc:
        return f"work-group function {kernel}/{spec} does not open: {exc}"
    return ""


if __name__ == "__main__":
    sys.exit(serve())
