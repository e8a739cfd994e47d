"""Build options as the driver sees them, and their normal form for the key.

pyopencl turns whatever the application passed (a string, split with ``shlex``, or a
list taken as is) into *one* byte string, its elements joined by single spaces, and adds
``-I <pyopencl's cl folder>`` and ``PYOPENCL_BUILD_OPTIONS`` (``Program._process_build_options``).
The driver then splits that string on whitespace: PoCL answers ``-DX=a b`` with
"Invalid build option: b", and keeps the quotes of a list element ``'"/x"'`` as part of
the folder's name. So the tokens here are ``options_bytes.split()``, exactly what the
driver gets, and a compile here always passes the original bytes, never a re-joined form.

The key's normal form drops the include folders (``-I dir`` and ``-Idir``): where a
header lives must not change the key; *what* it holds does, and
:mod:`farm.programs.includes` puts every header's digest in the key instead. Options
that name a file the farm cannot follow (``-include``, ``-imacros``, response files
``@file``, ``-iquote``...) make the program one the farm does not serve: it is built the
plain way.
"""

from __future__ import annotations

from dataclasses import dataclass

#: options whose argument is a file or folder the compiler reads, other than ``-I``
_UNFOLLOWED = ("-include", "-imacros", "-iquote", "-isystem", "-idirafter", "-iprefix",
               "-iwithprefix", "--include", "@")


@dataclass(frozen=True)
class Options:
    """One build's options: the tokens the key keeps, and the include folders in order."""

    #: every token that is not an include folder, in order
    kept: tuple[str, ...]
    #: the ``-I`` folders in the order given (quotes left as the driver sees them)
    include_dirs: tuple[str, ...]


class UnservedOptions(ValueError):
    """Options the farm cannot key (a file it cannot follow, bytes that are not UTF-8)."""


def parse_options(options: bytes) -> Options:
    """Split ``options`` (pyopencl's processed byte string) the way the driver does."""
    try:
        text = options.decode("utf-8")
    except UnicodeDecodeError:
        raise UnservedOptions("build options are not UTF-8") from None
    tokens = text.split()
    kept: list[str] = []
    dirs: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "-I":
            if i + 1 == len(tokens):
                raise UnservedOptions("build option -I names no folder")
            dirs.append(tokens[i + 1])
            i += 2
            continue
        if tok.startswith("-I"):
            dirs.append(tok[2:])
        elif tok.startswith(_UNFOLLOWED):
            raise UnservedOptions(f"build option {tok[:60]!r} names a file the farm does "
                                  "not follow")
        else:
            kept.append(tok)
        i += 1
    return Options(kept=tuple(kept), include_dirs=tuple(dirs))


def remote_options(kept: tuple[str, ...], roots: list[str]) -> bytes:
    """The options for a compile elsewhere: the kept tokens, then ``-I`` for each root
    folder laid out there, in the original order (see :mod:`farm.programs.includes`)."""
    parts = list(kept)
    for root in roots:
        parts += ["-I", root]
    return " ".join(parts).encode("utf-8")
