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
``@file``, ``-iquote``, a dependency file ``-MF``, a plugin ``-fplugin``, options passed
on to clang's own layers ``-Xclang``...) make the program one the farm does not serve: it
is built the plain way.

**Building elsewhere** (a capture's programs on the fleet, a worker compiling for an
application): a spec's options come from a file or a task, so they are input, and what
they could make a build host read or write is refused. A spec holds no include folder
at all (its headers travel in it, laid out under folders of the build's own), none of
the options above, and only tokens of a shape the farm builds elsewhere
(:func:`portable_options`): macro definitions, OpenCL's ``-cl-...`` options, warnings
(``-w``, ``-W...`` without a comma), ``-g`` and ``-O...``. An application's program with
other options is served where it runs (compiled and stored there) and never built
elsewhere (``portable`` False in its spec).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

#: options whose argument is a file or folder the compiler reads or writes, or code it
#: loads, other than ``-I`` (prefixes: ``-include-pch`` and ``-iwithprefixbefore`` too)
_UNFOLLOWED = ("-include", "-imacros", "-iquote", "-isystem", "-idirafter", "-iprefix",
               "-iwithprefix", "-isysroot", "--sysroot", "--include", "--config", "@",
               "-MF", "-MD", "-MMD", "-MT", "-MQ", "-o", "-save-temps", "--save-temps",
               "-fplugin", "-fpass-plugin", "-fmodule", "-fprofile", "-fsanitize",
               "-fcrash", "-Xclang", "-Xpreprocessor", "-mllvm", "-B", "-F", "-Wp,",
               "-Wa,", "-Wl,")
#: the shapes of option tokens built elsewhere (see the module docstring)
_PORTABLE = re.compile(r"-D\S+|-U\S+|-cl-[\w.+=-]+|-w|-W[\w=+-]*|-g|-O(?:[0-3sz]|fast)?")
#: options built elsewhere whose argument is the next token, and that argument's shape
_WITH_ARGUMENT = {"-D": re.compile(r"[^-]\S*"), "-U": re.compile(r"[A-Za-z_]\w*"),
                  "-cl-nv-arch": re.compile(r"sm_\d{2,3}"),
                  "-cl-nv-maxrregcount": re.compile(r"\d{1,4}"),
                  "-cl-nv-opt-level": re.compile(r"\d")}


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
        elif unfollowed(tok):
            raise UnservedOptions(f"build option {tok[:60]!r} names a file the farm does "
                                  "not follow")
        else:
            kept.append(tok)
        i += 1
    return Options(kept=tuple(kept), include_dirs=tuple(dirs))


def unfollowed(token: str) -> bool:
    """Whether ``token`` names a file or folder, or code to load, that the farm cannot
    follow (``-I`` aside: include folders are resolved, see the module docstring)."""
    return token.startswith(_UNFOLLOWED)


def portable_options(tokens: Sequence[str]) -> str:
    """Why ``tokens`` (a spec's options, include folders left out) cannot be built on
    another machine ("" when they can): the first token of a shape the farm does not
    build elsewhere, named (see the module docstring)."""
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        argument = _WITH_ARGUMENT.get(tok)
        if argument is not None:
            if i + 1 == len(tokens) or not argument.fullmatch(tokens[i + 1]):
                return f"build option {tok!r} is not followed by an argument it takes"
            i += 2
            continue
        if tok.startswith("-I"):
            return (f"build option {tok[:60]!r}: an include folder (a program's headers "
                    "travel with it)")
        if unfollowed(tok) or not _PORTABLE.fullmatch(tok):
            return (f"build option {tok[:60]!r} is not one the farm builds elsewhere (it "
                    "may name a file)")
        i += 1
    return ""


def remote_options(kept: tuple[str, ...], roots: list[str]) -> bytes:
    """The options for a compile elsewhere: the kept tokens, then ``-I`` for each root
    folder laid out there, in the original order (see :mod:`farm.programs.includes`)."""
    parts = list(kept)
    for root in roots:
        parts += ["-I", root]
    return " ".join(parts).encode("utf-8")
