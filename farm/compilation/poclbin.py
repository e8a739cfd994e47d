"""PoCL's program binary ("poclbin"): read its files, drop some, rename its folder.

What ``clGetProgramInfo(CL_PROGRAM_BINARIES)`` returns on PoCL is its cache folder for
the program, serialised (``lib/CL/pocl_binary.c``; versions 8, PoCL 3, to 11, PoCL 5)::

    "poclbin\\0" | device id u64 | version u32 | kernels u32 | flags u64
    | [v9+: root entries u32] | build hash, 41 bytes (the folder's name, a C string)
    | [v10+, flags & 2: program-scope variable bytes u64]
    | v8: program.bc as one file entry;  v9+: per root entry, u64 size + file entries
    | per kernel: u64 struct size | u64 files size | metadata | file entries

and a file entry is ``u32 length | path relative to the folder | u32 length | content``.
A kernel's files are its work-group functions, ``/<kernel>/<local size>[-goffs0]
[-smallgrid]/<kernel>.so``; ``0-0-0`` is the generic one. Integers are little-endian.

:func:`rewrite` is what :mod:`farm.compilation.ready` needs: drop the ``0-0-0`` entries
of some kernels, and give the program a build hash derived from the binary's content.
It never changes metadata or code; anything it cannot walk exactly is a
:class:`PoclBinaryError` (the caller then keeps the binary PoCL returned).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass

MAGIC = b"poclbin\0"
#: the versions whose layout this module reads
VERSIONS = range(8, 12)
#: ``SHA1_digest_t``: 20 bytes as hex, and a NUL
HASH_LEN = 41
#: the generic (not specialised) work-group function's folder
GENERIC = "0-0-0"
_FLAG_PROGRAM_SCOPE_VARS = 1 << 1
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class PoclBinaryError(ValueError):
    """The bytes are not a PoCL binary this module can walk exactly."""


@dataclass(frozen=True)
class KernelEntry:
    """One kernel's record: its name, where it lies, where its files start."""

    name: str
    start: int
    files_start: int
    end: int


@dataclass(frozen=True)
class Layout:
    """Where the parts of a binary lie."""

    version: int
    hash_at: int
    kernels_at: int
    kernels: tuple[KernelEntry, ...]


def _u32(buf: bytes, pos: int) -> int:
    if pos + 4 > len(buf):
        raise PoclBinaryError(f"truncated at byte {pos}")
    return int(_U32.unpack_from(buf, pos)[0])


def _u64(buf: bytes, pos: int) -> int:
    if pos + 8 > len(buf):
        raise PoclBinaryError(f"truncated at byte {pos}")
    return int(_U64.unpack_from(buf, pos)[0])


def layout(binary: bytes) -> Layout:
    """Walk ``binary``'s header, root entries and kernel records; every size is checked
    against the bytes there are."""
    if not binary.startswith(MAGIC):
        raise PoclBinaryError("not a PoCL binary (no 'poclbin' magic)")
    version, count, flags = _u32(binary, 16), _u32(binary, 20), _u64(binary, 24)
    if version not in VERSIONS:
        raise PoclBinaryError(f"PoCL binary version {version} is not one of "
                              f"{VERSIONS.start}..{VERSIONS.stop - 1}")
    pos = 32
    roots = None
    if version >= 9:
        roots, pos = _u32(binary, pos), pos + 4
    hash_at, pos = pos, pos + HASH_LEN
    if version >= 10 and flags & _FLAG_PROGRAM_SCOPE_VARS:
        pos += 8
    if roots is None:  # one file entry: program.bc
        pos = _skip_entry(binary, pos)
    else:
        for _ in range(roots):
            pos += 8 + _u64(binary, pos)
    kernels_at = pos
    kernels = []
    for _ in range(count):
        size, files = _u64(binary, pos), _u64(binary, pos + 8)
        end = pos + size
        if size < 24 or files > size - 24 or end > len(binary):
            raise PoclBinaryError(f"kernel record at byte {pos} has impossible sizes")
        length = _u32(binary, pos + 20)
        if pos + 24 + length > end - files:
            raise PoclBinaryError(f"kernel name at byte {pos} runs past its record")
        name = binary[pos + 24:pos + 24 + length].decode("utf-8", "replace")
        kernels.append(KernelEntry(name, pos, end - files, end))
        pos = end
    if pos != len(binary):
        raise PoclBinaryError(f"{len(binary) - pos} bytes after the last kernel")
    return Layout(version, hash_at, kernels_at, tuple(kernels))


def _skip_entry(binary: bytes, pos: int) -> int:
    pos += 4 + _u32(binary, pos)
    return pos + 4 + _u32(binary, pos)


def entries(binary: bytes, start: int, end: int) -> Iterator[tuple[str, int, int]]:
    """(relative path, entry start, entry end) of each file entry in ``[start, end)``."""
    pos = start
    while pos < end:
        length = _u32(binary, pos)
        path = binary[pos + 4:pos + 4 + length].decode("utf-8", "replace")
        nxt = _skip_entry(binary, pos)
        if nxt > end:
            raise PoclBinaryError(f"file entry at byte {pos} runs past its kernel")
        yield path, pos, nxt
        pos = nxt


def kernel_files(binary: bytes) -> dict[str, list[str]]:
    """Each kernel's files (relative paths), e.g. ``/matmul/16-16-1-goffs0-smallgrid/matmul.so``."""
    found = layout(binary)
    return {k.name: [p for p, _, _ in entries(binary, k.files_start, k.end)]
            for k in found.kernels}


def kernel_file_data(binary: bytes) -> dict[str, dict[str, bytes]]:
    """Each kernel's files with their contents: kernel -> {relative path: bytes}."""
    found = layout(binary)
    out: dict[str, dict[str, bytes]] = {}
    for k in found.kernels:
        files = out.setdefault(k.name, {})
        for path, start, _ in entries(binary, k.files_start, k.end):
            size_at = start + 4 + _u32(binary, start)
            files[path] = binary[size_at + 4:size_at + 4 + _u32(binary, size_at)]
    return out


def function_path(kernel: str, spec: str) -> str:
    """The relative path of ``kernel``'s work-group function for ``spec`` in a binary."""
    return f"/{kernel}/{spec}/{kernel}.so"


def add_files(binary: bytes, files: dict[str, dict[str, bytes]]) -> bytes:
    """``binary`` with ``files`` (kernel -> {relative path: bytes}) added to those
    kernels' records; a path the kernel already holds keeps its bytes, and the build
    hash stays (the files belong in the same folder). Kernels the binary lacks are a
    :class:`PoclBinaryError`: the caller decides what may be added, this only writes.
    """
    found = layout(binary)
    names = {k.name for k in found.kernels}
    if set(files) - names:
        raise PoclBinaryError(f"no kernel {sorted(set(files) - names)[0]!r} in the binary")
    out = [binary[:found.kernels_at]]
    for k in found.kernels:
        extra = files.get(k.name, {})
        held = {p for p, _, _ in entries(binary, k.files_start, k.end)}
        added = b"".join(_entry(p, d) for p, d in sorted(extra.items()) if p not in held)
        if not added:
            out.append(binary[k.start:k.end])
            continue
        meta = binary[k.start + 16:k.files_start]
        body = binary[k.files_start:k.end] + added
        out.append(_U64.pack(16 + len(meta) + len(body)) + _U64.pack(len(body)) + meta
                   + body)
    merged = b"".join(out)
    layout(merged)  # what was written walks exactly, or this raises
    return merged


def _entry(path: str, data: bytes) -> bytes:
    raw = path.encode("utf-8")
    if not raw or not data:
        raise PoclBinaryError("an empty file entry")  # PoCL asserts on either
    return _U32.pack(len(raw)) + raw + _U32.pack(len(data)) + data


def function_folder(path: str) -> str:
    """The work-group function's folder of ``path`` (``/k/16-1-1-goffs0/k.so``)."""
    parts = path.strip("/").split("/")
    return parts[-2] if len(parts) >= 2 else ""


def rewrite(binary: bytes, drop_generic: frozenset[str]) -> bytes:
    """``binary`` without the generic work-group functions of the kernels named in
    ``drop_generic``, under a build hash derived from its content.

    The build hash names the folder a loading process unpacks the program into and keys
    PoCL's table of loaded work-group functions. A source build with PoCL's kernel cache
    off names it by six random characters, so two different artifacts can meet under
    one name in one process (and the second would run the first one's code); a content
    hash is equal only for equal binaries.
    """
    found = layout(binary)
    out = [binary[:found.kernels_at]]
    for k in found.kernels:
        if k.name not in drop_generic:
            out.append(binary[k.start:k.end])
            continue
        files = b"".join(binary[a:b] for path, a, b in entries(binary, k.files_start, k.end)
                         if function_folder(path) != GENERIC)
        meta = binary[k.start + 16:k.files_start]
        out.append(_U64.pack(16 + len(meta) + len(files)) + _U64.pack(len(files))
                   + meta + files)
    body = b"".join(out)
    at = found.hash_at
    return body[:at] + _content_name(body, at) + body[at + HASH_LEN:]


def _content_name(binary: bytes, at: int, tag: bytes = b"") -> bytes:
    """The build hash field (41 bytes) naming ``binary`` by its content and ``tag``."""
    digest = hashlib.sha256(tag + binary[:at] + binary[at + HASH_LEN:]).hexdigest()
    return ("kf" + digest[:HASH_LEN - 3]).encode("ascii") + b"\0"


def named_by_content(binary: bytes) -> bool:
    """Whether ``binary``'s build hash is the one :func:`rewrite` gives its content: the
    folder it unpacks into then holds only what these very bytes hold (and what PoCL
    makes from them), never another binary's files under a borrowed name."""
    at = layout(binary).hash_at
    return binary[at:at + HASH_LEN] == _content_name(binary, at)


def renamed(binary: bytes, tag: bytes) -> bytes:
    """``binary`` under a build hash derived from ``tag`` and its content: a folder of
    its own for exactly these bytes, apart from any folder an untagged or differently
    tagged binary of the same program used (see :mod:`farm.programs.supplements`)."""
    at = layout(binary).hash_at
    return binary[:at] + _content_name(binary, at, tag) + binary[at + HASH_LEN:]


def build_hash(binary: bytes) -> str:
    """The folder name the binary unpacks into."""
    at = layout(binary).hash_at
    return binary[at:at + HASH_LEN].split(b"\0", 1)[0].decode("ascii", "replace")
