"""Making a PoCL program's work-group functions for given launch settings, launching
nothing.

PoCL's CPU drivers make a kernel's machine code, its *work-group function*, at the first
execution of a launch, specialised by local size, zero global offset and grid class
(docs/DESIGN.md, "Ready artifacts on PoCL"). A build host that knows a launch's settings
but not its buffers must not launch an opaque kernel to get it: the kernel may loop on,
or write through, whatever its arguments say. PoCL has another way in: when a program's
binary is taken (``clGetProgramInfo(CL_PROGRAM_BINARIES)``), it makes, for every kernel,
the work-group functions that ``POCL_BINARY_SPECIALIZE_WG`` lists (specialisation names
as its cache folders spell them, ``16-1-1-goffs0-smallgrid``, comma-separated), through
the same call and with the same parameters as a launch (``pocl_driver_build_poclbinary``,
PoCL 3.0 to 7.x). The function it makes is byte for byte the one a launch of that
geometry makes (checked on PoCL 3.0 and 3.1; ``tests/test_capture_ready.py``). No
argument is set, no buffer exists, no kernel runs.

That option is read once per process and applies to every kernel of every program, so a
:class:`FunctionMaker` is a child process of its own, started with the specialisations
its requests need. For each kernel, the listed specialisations it does not need, and its
generic function, get a stub where PoCL looks for them (:mod:`farm.compilation.elfstub`:
PoCL opens the stub instead of generating that function), so PoCL makes exactly the
functions asked for. The child is an isolated one (:mod:`farm.compilation.validate`): a
private PoCL cache, and a crash or a hang costs the child, nothing else. Before it makes
anything it loads the binary holding exactly the kernel names the caller says the
program has: the functions come from a binary validated in that very process.

Protocol: a request is ``{"names": [...], "wanted": [[kernel, spec], ...]}`` and the
binary; the answer ``{"error": "", "functions": [[kernel, spec, base64], ...]}``.
"""

from __future__ import annotations

import base64
import binascii
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from farm.compilation.elfstub import exports
from farm.compilation.poclbin import GENERIC
from farm.compilation.poclcache import KERNEL, SPEC
from farm.compilation.validate import IsolatedValidator
from farm.compilation.verdict import Verdict
from farm.core.hashing import sha256_hex

if TYPE_CHECKING:
    import pyopencl as cl

    from farm.core.device import DeviceInfo

#: PoCL's option: the specialisations taking a binary makes for every kernel
SPECIALIZE = "POCL_BINARY_SPECIALIZE_WG"
#: specialisations one child is started with at most (a kernel gets a stub for each one
#: it does not need; a request needing more gets a child of its own)
MAX_SPECS = 256
#: seconds a request may take: this, plus :data:`PER_FUNCTION_S` per function asked for
#: (a function takes 0.05 to 0.4 s to make on a CPU; a machine shared with a build is
#: slower)
BASE_TIMEOUT_S = 60.0
PER_FUNCTION_S = 10.0

#: (kernel, specialisation folder name)
Pair = tuple[str, str]


@dataclass(frozen=True)
class Specialized:
    """What a child made: the functions, or why none (``definite`` False: the child did
    not answer, which says nothing about the binary)."""

    functions: dict[Pair, bytes] = field(default_factory=dict)
    error: str = ""
    definite: bool = True


def wanted_specs(wanted: set[Pair] | frozenset[Pair]) -> frozenset[str]:
    return frozenset(spec for _, spec in wanted)


class FunctionMaker(IsolatedValidator):
    """A child on ``device`` whose PoCL makes the specialisations ``specs`` when it takes
    a binary; one request at a time. Thread-safe; :meth:`close` ends the child."""

    module = "farm.compilation.specialize"

    def __init__(self, device: DeviceInfo, specs: frozenset[str]) -> None:
        bad = sorted(s for s in specs if not SPEC.match(s))
        if bad:
            raise ValueError(f"not a specialisation PoCL makes: {bad[0]!r}")
        super().__init__(device, child_env={SPECIALIZE: ",".join(sorted(specs))})
        self.specs = specs
        self._sent: set[str] = set()

    def kill(self) -> None:
        """End the child now, even mid-request (the request then answers that it died)."""
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()

    def make(self, binary: bytes, kernels: tuple[str, ...], wanted: set[Pair]
             ) -> Specialized:
        """The work-group functions ``wanted`` of the program ``binary`` (holding exactly
        ``kernels``), made in the child; one not made is absent from the answer."""
        if not wanted_specs(wanted) <= self.specs:
            raise ValueError("a specialisation this child was not started with")
        digest = sha256_hex(binary)
        if digest in self._sent:  # PoCL would find its functions in memory, not make them
            self.close()
            self._sent.clear()
        self._sent.add(digest)
        answer = self.exchange({"names": list(kernels), "wanted": sorted(wanted)}, binary,
                               BASE_TIMEOUT_S + PER_FUNCTION_S * len(wanted))
        if isinstance(answer, Verdict):
            return Specialized(error=answer.why, definite=answer.definite)
        if answer["error"]:
            return Specialized(error=str(answer["error"]))
        return Specialized(functions=_received(answer.get("functions"), wanted))


def _received(items: object, wanted: set[Pair]) -> dict[Pair, bytes]:
    """The functions of an answer that are what was asked for: a pair asked for, an ELF
    shared object of this host exporting its kernel's symbol."""
    out: dict[Pair, bytes] = {}
    for item in items if isinstance(items, list) else ():
        if not (isinstance(item, list) and len(item) == 3
                and all(isinstance(x, str) for x in item)):
            continue
        pair = (item[0], item[1])
        try:
            data = base64.b64decode(item[2], validate=True)
        except (binascii.Error, ValueError):
            continue
        if pair in wanted and exports(data, pair[0]):
            out[pair] = data
    return out


# -- the child -------------------------------------------------------------------------------
def _make(ctx: cl.Context, cl_device: cl.Device, info: DeviceInfo, binary: bytes,
          request: dict[str, Any]) -> dict[str, Any]:
    """Load ``binary`` as a program holding exactly the kernels ``request`` names, then
    take its binary with stubs where every function not wanted would go; answer the
    wanted functions PoCL made."""
    import pyopencl as cl

    from farm.compilation.load import load_binary
    from farm.compilation.poclbin import PoclBinaryError, build_hash
    from farm.compilation.poclcache import loaded_folder
    from farm.compilation.ready import stubs_at
    from farm.core.errors import FarmError

    names = tuple(str(n) for n in request.get("names") or ())
    wanted = {(str(k), str(s)) for k, s in request.get("wanted") or ()}
    if not names or not all(KERNEL.match(n) for n in names):
        return {"error": "no kernel names, or names the farm does not handle"}
    try:
        loaded = load_binary(ctx, cl_device, binary, names, arch=info.native_arch)
        folder = loaded_folder(build_hash(binary))
    except (FarmError, PoclBinaryError) as exc:
        return {"error": str(exc)[:500]}
    if sorted(loaded.names) != sorted(names):
        return {"error": f"the binary holds kernels {', '.join(loaded.names) or 'none'}, "
                         f"its record says {', '.join(names)}"}
    if folder is None:
        return {"error": "PoCL did not unpack the binary into its cache folder"}
    specs = [s for s in os.environ.get(SPECIALIZE, "").split(",") if SPEC.match(s)]
    spared = [(k, GENERIC) for k in names] + [
        (k, s) for k in names for s in specs if (k, s) not in wanted]
    out = []
    try:
        with stubs_at(folder, spared):
            loaded.program.get_info(cl.program_info.BINARIES)
        for kernel, spec in sorted(wanted):
            path = folder / kernel / spec / f"{kernel}.so"
            data = path.read_bytes() if kernel in names and path.is_file() else b""
            if exports(data, kernel):
                out.append([kernel, spec, base64.b64encode(data).decode("ascii")])
    except (cl.Error, OSError) as exc:
        return {"error": f"PoCL did not make the functions: {exc}"[:500]}
    finally:
        del loaded
        shutil.rmtree(folder, ignore_errors=True)  # this child's private cache only
    return {"error": "", "functions": out}


if __name__ == "__main__":
    from farm.compilation.validate import serve

    sys.exit(serve(_make))
