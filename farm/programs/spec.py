"""The program artifact: what one ``pyopencl.Program(ctx, src).build(options)`` asked of
the driver, as data, and its key.

A program is opaque: the farm never parses it beyond its ``#include`` lines, and reads
its kernels' names from the built program. Its key (the ``id`` part of a store
:class:`~farm.core.model.Key`) is a SHA-256 over

* the source's SHA-256 (the bytes exactly as given: a source need not be UTF-8),
* the options the driver gets, minus the include folders (:mod:`farm.programs.options`),
* every ``#include`` line reachable from the source, each with the digests of every file
  its name could mean (:mod:`farm.programs.includes`): a changed header is a new key;

and the device fingerprint is the namespace, as for every artifact. The build id is
:data:`PROGRAM_BUILD_ID`: it changes only when the farm changes what it makes of a
program (bump :data:`~farm.programs.program_key.PROGRAM_FORMAT`), not with every farm
release, because the binary
depends on the source and the driver, not on the farm's code.

A :class:`ProgramSpec` travels in tasks and captures; the bytes travel by digest (store
blobs, or a capture's own table), so a task stays small whatever the source's size and
no source ever appears in an error message.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from farm.core.hashing import canonical_json, sha256_hex
from farm.core.model import SHA256_HEX, Frozen, Key
from farm.programs.includes import (
    MAX_HEADERS,
    Directive,
    HeaderFile,
    Includes,
    TooManyHeaders,
    resolve,
    root_folders,
)
from farm.programs.options import (
    Options,
    UnservedOptions,
    parse_options,
    portable_options,
    unfollowed,
)
from farm.programs.program_key import MAX_SOURCE_BYTES, PROGRAM_BUILD_ID, Unserved, program_id

Digest = Annotated[str, StringConstraints(pattern=SHA256_HEX)]
Token = Annotated[str, StringConstraints(min_length=1, max_length=8192)]
IncludeName = Annotated[str, StringConstraints(min_length=1, max_length=4096)]


class LaidOut(Frozen):
    """A header's place in the layout of a compile elsewhere (see ``includes``)."""

    root: int = Field(ge=0, le=4096)
    path: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    digest: Digest

    @field_validator("path")
    @classmethod
    def _relative(cls, value: str) -> str:
        """A path inside its root: relative, no ``..``, no empty or ``.`` parts (it comes
        from a task or a capture, and becomes a file name where it is compiled)."""
        parts = value.split("/")
        if value.startswith("/") or "\\" in value or "\x00" in value \
                or any(p in ("", ".", "..") for p in parts) \
                or posixpath.normpath(value) != value:
            raise ValueError(f"not a relative header path: {value[:80]!r}")
        return value


class ProgramSpec(Frozen):
    """One program as data: source and headers by digest, options, include lines."""

    format: Literal[1] = 1
    source: Digest
    source_size: int = Field(ge=0, le=MAX_SOURCE_BYTES)
    #: the driver's option tokens without the include folders, in order
    options: tuple[Token, ...] = Field(default=(), max_length=4096)
    #: every include line reachable from the source: (name, quoted, digests found)
    includes: tuple[tuple[IncludeName, bool, tuple[Digest, ...]], ...] = Field(
        default=(), max_length=4 * MAX_HEADERS)
    #: root folders of the layout (0: the current folder, then each -I folder)
    roots: int = Field(default=0, ge=0, le=4096)
    headers: tuple[LaidOut, ...] = Field(default=(), max_length=4 * MAX_HEADERS)
    #: False: the headers cannot be laid out elsewhere; compiled only where it was built
    portable: bool = True

    @field_validator("options")
    @classmethod
    def _no_files(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """A spec's options name no file or folder (its headers travel with it): the
        same rules as an application's (``farm.programs.options``)."""
        for tok in value:
            if tok.startswith("-I") or unfollowed(tok):
                raise ValueError(f"build option {tok[:60]!r} names a file or folder; a "
                                 "program's headers travel in its spec")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ProgramSpec:
        if any(h.root >= self.roots for h in self.headers):
            raise ValueError("a header names a root the layout does not have")
        found = {d for _, _, ds in self.includes for d in ds}
        if self.portable and not found <= {h.digest for h in self.headers}:
            raise ValueError("an included header is missing from the layout")
        why = portable_options(self.options) if self.portable else ""
        if why:
            raise ValueError(f"{why}; a portable program is built on other machines")
        return self

    @property
    def key(self) -> Key:
        """The store key: a SHA-256 of source, options and include lines."""
        return Key(id_hash=program_id(self.source, self.options, self.includes),
                   build_id=PROGRAM_BUILD_ID)

    def digests(self) -> list[str]:
        """The blobs a compile elsewhere needs: the source, then every header."""
        return list(dict.fromkeys([self.source, *(h.digest for h in self.headers)]))

    def to_blob(self) -> bytes:
        """The spec as stored beside its artifact (canonical JSON): a program artifact's
        ``source_hash`` is this blob's digest, so the artifact names its sources (a
        bundle carries them; see :mod:`farm.programs.bundles`)."""
        return canonical_json(self.model_dump(mode="json")).encode("utf-8")

    @property
    def blob_digest(self) -> str:
        return sha256_hex(self.to_blob())

    @classmethod
    def of(cls, source_digest: str, source_size: int, options: Options,
           includes: Includes, roots: int) -> ProgramSpec:
        """The spec of one build, from what :mod:`~farm.programs.options` and
        :mod:`~farm.programs.includes` found."""
        directives: tuple[Directive, ...] = includes.directives
        return cls(source=source_digest, source_size=source_size, options=options.kept,
                   includes=directives, roots=roots if includes.portable else 0,
                   headers=tuple(LaidOut(root=h.root, path=h.path, digest=h.digest)
                                 for h in includes.layout) if includes.portable else (),
                   portable=includes.portable)

    def layout(self) -> tuple[HeaderFile, ...]:
        """The headers as :func:`farm.programs.includes.lay_out` writes them."""
        return tuple(HeaderFile(h.root, h.path, h.digest) for h in self.headers)


@dataclass(frozen=True)
class Described:
    """One build as the farm handles it: the spec, and the bytes its digests name."""

    spec: ProgramSpec
    source: bytes
    #: exactly what pyopencl hands the driver (a compile here passes it unchanged)
    options: bytes
    #: header digest -> bytes
    headers: dict[str, bytes]

    def blobs(self) -> dict[str, bytes]:
        """Every blob of the program: the source, the headers and the spec, by digest."""
        return {self.spec.source: self.source, **self.headers,
                self.spec.blob_digest: self.spec.to_blob()}


def describe(source: bytes, options: bytes, cwd: str) -> Described:
    """The spec of a build of ``source`` with pyopencl's processed ``options`` in the
    current folder ``cwd``; :class:`Unserved` when the farm cannot key it."""
    if len(source) > MAX_SOURCE_BYTES:
        raise Unserved(f"the source has {len(source)} bytes, over the farm's limit of "
                       f"{MAX_SOURCE_BYTES}")
    try:
        parsed = parse_options(options)
        roots = root_folders(cwd, parsed.include_dirs)
        includes = resolve(source, roots)
    except (UnservedOptions, TooManyHeaders) as exc:
        raise Unserved(str(exc)) from None
    if any(len(b) > MAX_SOURCE_BYTES for b in includes.contents.values()):
        raise Unserved(f"a header is over the farm's limit of {MAX_SOURCE_BYTES} bytes")
    why = portable_options(parsed.kept)
    if why and includes.portable:  # served here, never built elsewhere
        includes.portable, includes.why_local = False, why
    spec = ProgramSpec.of(sha256_hex(source), len(source), parsed, includes, len(roots))
    return Described(spec=spec, source=source, options=options, headers=includes.contents)
