"""A program's key, computed with the standard library only.

:class:`~farm.programs.spec.ProgramSpec` (a pydantic model: it travels in tasks and
captures) computes its key here, and so does the served application's quick path
(:mod:`farm.programs.quick`), which looks a binary up before anything of pydantic is
imported. What the key covers is said in :mod:`farm.programs.spec`.
"""

from __future__ import annotations

from farm.core.hashing import sha256_hex, stable_hash
from farm.core.keys import PROGRAM_FAMILY
from farm.programs.includes import Directive, TooManyHeaders, root_folders, scan
from farm.programs.options import UnservedOptions, parse_options

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

#: bump when the farm changes what it stores for a program (every key changes with it)
PROGRAM_FORMAT = 2  # 2: the stored bytes are a body (farm.programs.body)
#: the format of a program's spec (:class:`farm.programs.spec.ProgramSpec`), which its
#: key's ``id`` hashes: the build id changes with what is stored, the id with what is
#: asked
SPEC_FORMAT = 1
PROGRAM_BUILD_ID = stable_hash({"kind": PROGRAM_FAMILY, "format": PROGRAM_FORMAT}, 24)

#: the largest source or header the farm keeps (a bigger one is built the plain way)
MAX_SOURCE_BYTES = 64 * 1024 * 1024


class Unserved(ValueError):
    """A build the farm does not serve (it is built the plain way); the message says why."""


def program_id(source_digest: str, options: Sequence[str],
               includes: Sequence[Directive]) -> str:
    """The ``id`` part of a program's key: a SHA-256 of source, options and include
    lines (the build id is :data:`PROGRAM_BUILD_ID`)."""
    return stable_hash({"format": SPEC_FORMAT, "source": source_digest,
                        "options": list(options),
                        "includes": [[n, q, list(d)] for n, q, d in includes]}, 64)


def program_id_of(source: bytes, options: bytes, cwd: str) -> str:
    """:func:`program_id` of a build of ``source`` with pyopencl's processed ``options``
    in the folder ``cwd``; :class:`Unserved` when the farm cannot key it (the same rules
    as :func:`farm.programs.spec.describe`)."""
    if len(source) > MAX_SOURCE_BYTES:
        raise Unserved(f"the source has {len(source)} bytes, over the farm's limit of "
                       f"{MAX_SOURCE_BYTES}")
    try:
        parsed = parse_options(options)
        directives, _, contents = scan(source, root_folders(cwd, parsed.include_dirs))
    except (UnservedOptions, TooManyHeaders) as exc:
        raise Unserved(str(exc)) from None
    if any(len(b) > MAX_SOURCE_BYTES for b in contents.values()):
        raise Unserved(f"a header is over the farm's limit of {MAX_SOURCE_BYTES} bytes")
    return program_id(sha256_hex(source), parsed.kept, directives)
