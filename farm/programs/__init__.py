"""Programs: existing OpenCL applications served by the farm with no change to their code.

A family (``farm.families``) describes kernels the farm knows how to generate. Most
OpenCL code in the wild generates its own source at run time (pyopencl.array, reikna,
loopy) and calls ``pyopencl.Program(ctx, src).build(options)``. The farm serves those
builds too, as opaque *programs*: keyed by the source, the normalised options and the
contents of every header the source can include (:mod:`.spec`, :mod:`.options`,
:mod:`.includes`), obtained by the farm's own tiers and compile path on the
application's own context (:mod:`.serve`, :mod:`.assemble`; a stored binary by the
quick path first, :mod:`.quick`, with nothing heavy imported), hooked in with one line or
none (:mod:`.hook`, :mod:`.autoinstall` for ``farm run``), with the code pyopencl and
loopy generate served too (:mod:`.generated`), and captured for the fleet to build
ahead of time (:mod:`.capture`). docs/PYOPENCL.md is the user's guide.

    from farm.programs import install
    install()            # every pyopencl Program.build of this process is served
"""

# ruff: noqa: F401 - the TYPE_CHECKING block is the list of public names (farm.core.lazy)
from __future__ import annotations

from farm.core.lazy import public_names

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (farm run)
if TYPE_CHECKING:
    from farm.programs.hook import install, installed, uninstall
    from farm.programs.spec import ProgramSpec

__getattr__, __dir__ = public_names(__name__)
