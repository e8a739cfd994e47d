"""ELF shared objects as PoCL's work-group functions are: a stub that holds no code, and
a check that a file exports a kernel's work-group symbol.

Why a stub: taking a PoCL program's binary makes PoCL generate a *generic* work-group
function for every kernel first (``0-0-0/<kernel>.so``), which no launch uses while the
binary carries ``program.bc`` (see :mod:`farm.compilation.ready`). PoCL skips that
generation when the file already exists, and then only ``dlopen``\\ s it and looks up
``_pocl_kernel_<kernel>_workgroup`` (a missing symbol aborts the process). So a file that
dlopen accepts and that exports that one symbol is all it takes. :func:`stub` writes
one: an ELF header, three program headers (one read-write ``PT_LOAD``, ``PT_DYNAMIC``,
``PT_GNU_STACK``), a SysV hash table, two symbols and the dynamic section, about 500
bytes. It has no executable page at all: the symbol points at data, so a call to it
faults instead of running anything (PoCL never calls it: its entry is filed under a
grid width of 0, which no launch has). Every stub carries :data:`MARKER`, so a stub is
recognised wherever it turns up (:func:`is_stub`) and never stored or served.

Why the check: a work-group function read back from a cache folder or from the store
(:mod:`farm.programs.supplements`) is ``dlopen``\\ ed by PoCL at a launch; one that is not
an ELF shared object of this machine exporting the kernel's symbol would make PoCL abort
the application. :func:`exports` reads the section headers and the dynamic symbol table
with every offset checked against the bytes there are.

Only little-endian 64-bit hosts this module knows (x86-64, AArch64); elsewhere
:func:`stub` answers ``None`` and the callers keep PoCL's plain behaviour.
"""

from __future__ import annotations

import functools
import os
import platform
import struct
import tempfile

#: ``e_machine`` of the hosts this module writes stubs for
_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}
#: written into every stub; a file that holds it is never a real work-group function
MARKER = b"kernel-farm: generic work-group stub, holds no code"
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_DYN = struct.Struct("<qQ")
_ET_DYN = 3
_SHT_DYNSYM = 11
_PF_RW = 4 | 2
#: a page alignment that suits 4 KiB and 64 KiB pages
_ALIGN = 0x10000
#: a real work-group function is tens of KiB; anything larger than this is refused
MAX_FUNCTION_BYTES = 64 * 1024 * 1024


def host_machine() -> int | None:
    """This host's ``e_machine``, ``None`` where this module writes no stubs."""
    if struct.calcsize("P") != 8 or struct.pack("=H", 1) != b"\x01\x00":
        return None
    return _MACHINES.get(platform.machine().lower())


def workgroup_symbol(kernel: str) -> str:
    """The symbol PoCL looks up in a kernel's work-group function."""
    return f"_pocl_kernel_{kernel}_workgroup"


def stub(kernel: str) -> bytes | None:
    """A shared object exporting ``kernel``'s work-group symbol and no code."""
    machine = host_machine()
    if machine is None:
        return None
    symbol = workgroup_symbol(kernel).encode("ascii")
    hash_at = _EHDR.size + 3 * _PHDR.size
    hashes = struct.pack("<5I", 1, 2, 1, 0, 0)  # one bucket -> symbol 1, chains end
    syms_at = _align8(hash_at + len(hashes))
    strs_at = syms_at + 2 * _SYM.size
    strs = b"\0" + symbol + b"\0" + MARKER + b"\0"
    marker_at = strs_at + 2 + len(symbol)
    dyn_at = _align8(strs_at + len(strs))
    dyn = b"".join(_DYN.pack(tag, value) for tag, value in (
        (4, hash_at), (5, strs_at), (6, syms_at), (10, len(strs)), (11, _SYM.size), (0, 0)))
    size = dyn_at + len(dyn)
    ident = b"\x7fELF" + bytes((2, 1, 1, 0, 0)) + bytes(7)
    out = bytearray(size)
    out[0:_EHDR.size] = _EHDR.pack(ident, _ET_DYN, machine, 1, 0, _EHDR.size, 0, 0,
                                   _EHDR.size, _PHDR.size, 3, _SHDR.size, 0, 0)
    out[_EHDR.size:hash_at] = (
        _PHDR.pack(1, _PF_RW, 0, 0, 0, size, size, _ALIGN)                      # PT_LOAD
        + _PHDR.pack(2, _PF_RW, dyn_at, dyn_at, dyn_at, len(dyn), len(dyn), 8)  # PT_DYNAMIC
        + _PHDR.pack(0x6474E551, _PF_RW, 0, 0, 0, 0, 0, 16))                    # GNU_STACK
    out[hash_at:hash_at + len(hashes)] = hashes
    # symbol 1: global function, in "section" 1, pointing at the marker (data, no code)
    out[syms_at + _SYM.size:strs_at] = _SYM.pack(1, 0x12, 0, 1, marker_at, 0)
    out[strs_at:strs_at + len(strs)] = strs
    out[dyn_at:size] = dyn
    return bytes(out)


def _align8(n: int) -> int:
    return (n + 7) & ~7


def is_stub(data: bytes) -> bool:
    """Whether ``data`` is one of :func:`stub`'s files (by its marker)."""
    return data.startswith(b"\x7fELF") and MARKER in data[:4096]


@functools.cache
def stubs_load() -> bool:
    """Whether this process's dynamic loader accepts a stub and finds its symbol (tried
    once, with ctypes, before PoCL is ever handed one: a stub PoCL could not open would
    abort the application)."""
    import ctypes  # here: a process that only checks files never needs it

    data = stub("kernel_farm_probe")
    if data is None:
        return False
    with tempfile.TemporaryDirectory(prefix="farm-stub-") as folder:
        path = os.path.join(folder, "probe.so")
        with open(path, "wb") as fh:
            fh.write(data)
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
            return bool(getattr(lib, workgroup_symbol("kernel_farm_probe")) is not None)
        except (OSError, AttributeError):
            return False


def exports(data: bytes, kernel: str) -> bool:
    """Whether ``data`` is an ELF shared object of this host that exports ``kernel``'s
    work-group symbol (defined), and no stub. Never raises."""
    try:
        return _exports(data, workgroup_symbol(kernel).encode("ascii"))
    except (struct.error, IndexError, ValueError, UnicodeError):
        return False


def _exports(data: bytes, symbol: bytes) -> bool:
    if len(data) > MAX_FUNCTION_BYTES or len(data) < _EHDR.size or is_stub(data):
        return False
    ident, e_type, machine, *_rest = _EHDR.unpack_from(data, 0)
    shoff, shentsize, shnum = _rest[3], _rest[8], _rest[9]
    if (ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1 or e_type != _ET_DYN
            or machine != host_machine() or shentsize != _SHDR.size
            or not 0 < shnum <= 4096 or shoff + shnum * _SHDR.size > len(data)):
        return False
    sections = [_SHDR.unpack_from(data, shoff + i * _SHDR.size) for i in range(shnum)]
    for sh in sections:
        if sh[1] != _SHT_DYNSYM:
            continue
        offset, size, link, entsize = sh[4], sh[5], sh[6], sh[9]
        if entsize != _SYM.size or offset + size > len(data) or link >= shnum:
            return False
        str_off, str_size = sections[link][4], sections[link][5]
        if str_off + str_size > len(data):
            return False
        strings = data[str_off:str_off + str_size]
        for at in range(offset, offset + size - _SYM.size + 1, _SYM.size):
            name, _info, _other, shndx, value, _size = _SYM.unpack_from(data, at)
            if name >= len(strings) or shndx == 0 or value == 0:
                continue
            end = strings.find(b"\0", name)
            if strings[name:end if end >= 0 else len(strings)] == symbol:
                return True
        return False
    return False
