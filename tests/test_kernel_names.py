"""A built program's kernel names, read in one place (``farm.compilation.load.
program_kernels``): NVIDIA's driver lists CUDA's internal helpers among the kernels of a
program loaded from a cubin (``['__cuda_sm20_div_u64', 'axpb']`` where the same source
built lists ``['axpb']``), so every check that compares a loaded program's kernels with
a compile's (the server's store, a family's load, the proof's child) refused every
program that divides 64-bit integers or rounds doubles, and each run compiled them again.

No NVIDIA device here: the driver's list is faked at its seam
(``farm.compilation.load.listed_kernels``) on the local PoCL, for a loaded binary only,
as NVIDIA's driver does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyopencl as cl
import pytest

import farm.compilation.load as load_module
from farm.compilation.load import load_binary, program_kernels, reserved
from farm.core.device import info_from_device
from farm.core.settings import Settings
from farm.programs.body import read_body
from farm.programs.serve import ProgramServer
from farm.store.memory import MemoryStore

SOURCE = "__kernel void axpb(__global long *a, long b) { a[0] = a[0] / b; }\n"
HELPERS = ("__cuda_sm20_div_u64", "__cuda_sm20_dblrcp_rn_slowpath_v3")


class _Listed:
    """A built program as the reader asks it: only its kernel names."""

    def __init__(self, names: str) -> None:
        self.names = names

    def get_info(self, arg: Any) -> object:
        assert arg == cl.program_info.KERNEL_NAMES
        return self.names

    def get_build_info(self, device: Any, param: Any) -> object:
        raise AssertionError("not asked")


def test_names_reserved_to_the_implementation_are_not_a_programs_kernels() -> None:
    listed = _Listed("__cuda_sm20_div_u64;axpb;__cuda_sm20_dblrcp_rn_slowpath_v3;_Tail")
    assert program_kernels(listed) == ("axpb", "_Tail")
    # a family may declare any valid name: what it declares is kept
    assert program_kernels(_Listed("__mine;axpb"), ("__mine", "axpb")) == ("__mine", "axpb")
    assert [reserved(n) for n in ("__cuda_x", "__x", "_x", "x__")] == [True, True, False,
                                                                        False]


@pytest.fixture(scope="module")
def ctx() -> Any:
    return cl.Context([next(d for p in cl.get_platforms() if "Portable" in p.name
                            for d in p.get_devices())])


def _like_nvidia(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's list as NVIDIA's gives it for a program made from a binary."""
    real = load_module.listed_kernels

    def listed(program: Any) -> tuple[str, ...]:
        names = real(program)
        return (HELPERS[0], *names, HELPERS[1]) if _loaded(program) else names

    monkeypatch.setattr(load_module, "listed_kernels", listed)


def _loaded(program: Any) -> bool:
    """Whether ``program`` was made from a binary (its source is empty)."""
    try:
        return not str(program.get_info(cl.program_info.SOURCE))
    except cl.Error:
        return True


def test_a_loaded_programs_helpers_never_refuse_it(ctx: Any, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The server stores the program it compiled (its load lists the helpers), a second
    process loads it; a family's load and the proof's check accept the binary."""
    _like_nvidia(monkeypatch)
    dev = ctx.devices[0]
    built = cl.Program(ctx, SOURCE).build()
    binary = bytes(built.get_info(cl.program_info.BINARIES)[0])
    reloaded = cl.Program(ctx, [dev], [binary]).build()
    assert load_module.listed_kernels(reloaded) == (HELPERS[0], "axpb", HELPERS[1])
    assert load_binary(ctx, dev, binary, ("axpb",)).names == ("axpb",)

    from farm.compilation.validate import check_binary  # the proof's child, here

    info = info_from_device(0, 0, dev)
    assert check_binary(ctx, dev, info.native_arch, binary,
                        {"names": ["axpb"], "require_kernel": False}) == ""

    store = MemoryStore()
    settings = Settings(home=tmp_path, device=None, records_url=None, pocl_ready=False)
    first = ProgramServer(settings, store=store)
    first.build(cl.Program(ctx, SOURCE), None, None, lambda: pytest.fail("plain build"))
    assert first.counts.snapshot()["compiled"] == 1
    [ns] = store.namespaces()
    [key] = store.keys(ns)
    art = store.get(ns, key)
    assert art is not None, "the server refused to store its own compile"
    assert read_body(art.binary, key, info.fingerprint).kernels == ("axpb",)
    second = ProgramServer(settings, store=store)
    second.build(cl.Program(ctx, SOURCE), None, None, lambda: pytest.fail("plain build"))
    assert second.counts.snapshot()["loaded"] == 1
    first.close()
    second.close()
