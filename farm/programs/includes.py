"""Every header a program's source can include, for its key and for a compile elsewhere.

The compiler finds ``#include "x.h"`` in the includer's own folder first, then in the
process's current folder (PoCL passes ``-I.`` before the application's options), then
in each ``-I`` folder in order; ``#include <x.h>`` skips the includer's folder. Which of
those a given driver searches, and in which order, is its business, so the key does not
guess: for every ``#include`` line (of the source, and recursively of every header found)
it records the digests of **every** file the name could mean, in search order. A change
to any file the compiler might read, a header that appears or disappears, or two
folders swapped that hold different ``x.h`` is a new key; where the folders are is not.
Conditionals are not evaluated (an ``#include`` under ``#if 0`` counts too): a key that
covers too much only misses, one that covers too little would serve a stale binary.

For a compile on another machine the headers travel by digest and are laid out again
under one folder per *root* (root 0: the application's current folder, then its ``-I``
folders), each file at its path relative to every root that holds it. The layout is
checked by resolving the source again over it in memory: a program whose includes do not
come out the same (a header outside every root, reached through ``..`` or an absolute
name) is compiled only where it was built (``portable`` is False). So is one whose
``#include`` could reach outside every root on the build host even where nothing was
found here (an absolute name, enough ``..``: the build host would read its own file
there), and one that includes by a macro's name (``#include HEADER``), which no scan can
follow: a build elsewhere only ever reads the headers the program carries
(:func:`reaches_outside`).
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from farm.core.hashing import sha256_hex

#: ``#include "name"`` or ``#include <name>`` at the start of a line (``#include_next``
#: and ``#import``, which clang also reads in C, alike)
_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*(?:include(?:_next)?|import)[ \t]*([<"])([^">\r\n]+)[">]',
                      re.MULTILINE)
#: an ``#include`` by a macro's name (or anything but a quoted or bracketed name)
_BY_MACRO = re.compile(rb'^[ \t]*#[ \t]*(?:include(?:_next)?|import|embed)\b[ \t]*[^ \t<"\r\n]',
                       re.MULTILINE)

#: headers one program may reach; past it the program is built the plain way
MAX_HEADERS = 4096

#: one ``#include`` line: the name as written, whether quoted, the digests found
Directive = tuple[str, bool, tuple[str, ...]]


@dataclass(frozen=True)
class HeaderFile:
    """A header as laid out for a compile elsewhere: root index, relative path, digest."""

    root: int
    path: str
    digest: str


@dataclass
class Includes:
    """What a source includes: the key's part, the headers' bytes, and their layout."""

    directives: tuple[Directive, ...]
    contents: dict[str, bytes] = field(default_factory=dict)
    layout: tuple[HeaderFile, ...] = ()
    portable: bool = True
    why_local: str = ""


class TooManyHeaders(ValueError):
    """A source that reaches more than :data:`MAX_HEADERS` files."""


Reader = Callable[[str], "bytes | None"]


def read_file(path: str) -> bytes | None:
    """A regular file's bytes; ``None`` for anything the compiler could not read."""
    try:
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def root_folders(cwd: str, include_dirs: Sequence[str]) -> list[str]:
    """The folders searched, real and absolute, first occurrence kept: the current one,
    then each ``-I`` folder (a quoted one also unquoted: drivers differ)."""
    roots: list[str] = []
    for raw in (cwd, *include_dirs):
        for name in dict.fromkeys((raw, raw.strip('"'))):
            if not name:
                continue
            real = os.path.realpath(os.path.join(cwd, name))
            if real not in roots:
                roots.append(real)
    return roots


def scan(source: bytes, roots: Sequence[str], read: Reader = read_file,
         realpath: Callable[[str], str] = os.path.realpath,
         outside: set[str] | None = None
         ) -> tuple[tuple[Directive, ...], dict[str, str], dict[str, bytes]]:
    """Every ``#include`` of ``source``, recursively, against ``roots`` (absolute):
    (directives sorted, real path -> digest of every file read, digest -> bytes).
    ``outside`` receives each name that, searched from some folder, lies outside every
    root."""
    contents: dict[str, bytes] = {}
    visited: dict[str, str] = {}
    directives: set[Directive] = set()
    stack: list[tuple[bytes, str | None]] = [(source, None)]
    while stack:
        text, here = stack.pop()
        for match in _INCLUDE.finditer(text):
            quoted = match.group(1) == b'"'
            name = match.group(2).decode("utf-8", "surrogateescape").strip()
            folders = ([here] if quoted and here is not None else []) + list(roots)
            found: list[str] = []
            for path in dict.fromkeys(realpath(posixpath.join(f, name)) for f in folders):
                if outside is not None and not _within(path, roots):
                    outside.add(name)
                if path not in visited:
                    data = read(path)
                    if data is None:
                        continue
                    if len(visited) >= MAX_HEADERS:
                        raise TooManyHeaders(f"the source reaches more than {MAX_HEADERS} "
                                             "headers")
                    visited[path] = digest = sha256_hex(data)
                    contents[digest] = data
                    stack.append((data, posixpath.dirname(path)))
                found.append(visited[path])
            directives.add((name, quoted, tuple(found)))
    return tuple(sorted(directives)), visited, contents


def _within(path: str, roots: Sequence[str]) -> bool:
    return any(path.startswith(root.rstrip("/") + "/") for root in roots)


def reaches_outside(sources: Sequence[bytes], names: set[str]) -> str:
    """Why a program whose ``sources`` (its source and headers) include ``names`` (those
    reaching outside its roots) cannot be built elsewhere, "" when it can."""
    if names:
        return f"an #include can reach outside the program's folders ({sorted(names)[0]!r})"
    if any(_BY_MACRO.search(text) for text in sources):
        return "an #include names its header by a macro, which cannot be followed"
    return ""


def resolve(source: bytes, roots: Sequence[str]) -> Includes:
    """The includes of ``source`` on this machine, laid out and checked for elsewhere."""
    outside: set[str] = set()
    directives, visited, contents = scan(source, roots, outside=outside)
    result = Includes(directives=directives, contents=contents)
    why = reaches_outside([source, *contents.values()], outside)
    if why:
        result.portable, result.why_local = False, why
        return result
    layout: list[HeaderFile] = []
    for path, digest in sorted(visited.items()):
        homes = [HeaderFile(k, posixpath.relpath(path, root), digest)
                 for k, root in enumerate(roots)
                 if path.startswith(root.rstrip("/") + "/")]
        if not homes:
            result.portable = False
            result.why_local = f"header {posixpath.basename(path)!r} lies outside the " \
                               "current and -I folders"
            return result
        layout.extend(homes)
    result.layout = tuple(layout)
    again, _, _ = scan_laid_out(source, len(roots), result.layout, contents)
    if again != directives:
        result.portable = False
        result.why_local = "its headers do not resolve the same when laid out elsewhere"
    return result


def virtual_root(index: int) -> str:
    """Root ``index`` of a layout, as a folder under a compile's own folder."""
    return f"r{index}"


def scan_laid_out(source: bytes, roots: int, layout: Sequence[HeaderFile],
                  contents: dict[str, bytes], outside: set[str] | None = None
                  ) -> tuple[tuple[Directive, ...], dict[str, str], dict[str, bytes]]:
    """:func:`scan` over ``layout`` held in memory (roots ``/r0``, ``/r1``...): what a
    compile elsewhere will see, computed without writing a file."""
    files = {posixpath.normpath(f"/{virtual_root(h.root)}/{h.path}"): contents.get(h.digest)
             for h in layout}
    return scan(source, [f"/{virtual_root(k)}" for k in range(roots)],
                read=files.get, realpath=posixpath.normpath, outside=outside)


def lay_out(folder: str, layout: Sequence[HeaderFile], contents: dict[str, bytes],
            roots: int) -> list[str]:
    """Write ``layout`` under ``folder`` (which must be empty and private); returns the
    root folders in order. Paths were checked relative (never ``..``) when parsed."""
    made = []
    for k in range(roots):
        path = os.path.join(folder, virtual_root(k))
        os.makedirs(path, exist_ok=True)
        made.append(path)
    for h in layout:
        target = os.path.join(folder, virtual_root(h.root), *h.path.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as fh:
            fh.write(contents[h.digest])
    return made
