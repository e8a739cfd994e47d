"""Generated code served like binaries: the rows of pytools' persistent dictionaries.

pyopencl and loopy keep what they generate before a build in ``pytools`` persistent
dictionaries under ``XDG_CACHE_HOME``: pyopencl the Python invokers of its kernels and
the Mako-rendered sources of its scans, loopy its code generation, schedules and
invokers. A node that ran an application has them; a fresh node renders, schedules and
generates them all again (0.1 to 0.3 s for the benchmark's applications, Mako's import
included), even when the farm serves every binary. So the farm keeps them too:

* **What.** One artifact per application and dictionary (family
  :data:`GENERATED_FAMILY`, in the namespace :data:`GENERATED_NAMESPACE`: the rows name
  devices themselves where they depend on one), holding the rows the application used,
  as the dictionary stores them (its key's hash and the pickle of key and value). The
  application is the digest of its main script; the dictionary is its file's name,
  which carries the library's and Python's versions; pyopencl's and pytools' versions
  join the key as well.
* **Read.** A dictionary's first miss in a process asks the farm (the quick path's
  reads: the node's local tier, then MinIO) for that artifact and adds its rows to the
  node's dictionary file, where pytools then finds them (and checks, as always, that
  the row's key is the one asked for).
* **Written** at the process's end, by the first process that found none (first writer
  wins), through the program server's store.

A row is a pickle, which runs code when it is read: the same trust as a stored binary,
which is machine code (digest-verified, from the farm's store only); a store that checks
signatures is not served from here (the quick path declines everything then).
"""

from __future__ import annotations

import os
import struct
import threading

from farm.core.hashing import stable_hash
from farm.programs.plan import application_digest

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Callable
    from typing import Protocol, TypeVar

    T = TypeVar("T")

    class _KeyBuilder(Protocol):
        def __call__(self, key: object) -> str: ...

    class _Dict(Protocol):
        """What the farm uses of a pytools persistent dictionary."""

        filename: str
        conn: sqlite3.Connection
        key_builder: _KeyBuilder

        def _exec_sql_fn(self, fn: Callable[[], T]) -> T | None: ...

    #: (key id, build id) -> the artifact's bytes, verified, or None
    Reader = Callable[[str, str], "bytes | None"]
    #: (key id, build id, bytes) -> stored
    Writer = Callable[[str, str, bytes], None]

GENERATED_FAMILY = "generated-code"
#: the pseudo-fingerprint of the namespace generated code is kept in
GENERATED_NAMESPACE = "generated-code"
_FORMAT = 1
GENERATED_BUILD_ID = stable_hash({"kind": GENERATED_FAMILY, "format": _FORMAT}, 24)
MAGIC = b"KFPDICT1"
_LEN = struct.Struct(">I")
#: rows one artifact holds at most, and bytes
MAX_ROWS = 100_000
MAX_BYTES = 256 * 1024 * 1024


def encode(rows: dict[str, bytes]) -> bytes:
    """The artifact's bytes: magic, then each row as (length, key hash, length, value)."""
    out = [MAGIC, _LEN.pack(len(rows))]
    for keyhash, value in sorted(rows.items()):
        raw = keyhash.encode("ascii")
        out += [_LEN.pack(len(raw)), raw, _LEN.pack(len(value)), value]
    return b"".join(out)


def decode(data: bytes) -> dict[str, bytes]:
    """Inverse of :func:`encode`; ``ValueError`` for anything else."""
    if not data.startswith(MAGIC) or len(data) > MAX_BYTES:
        raise ValueError("not a generated-code artifact")
    at = len(MAGIC)
    (count,) = _LEN.unpack_from(data, at)
    at += _LEN.size
    if count > MAX_ROWS:
        raise ValueError("too many rows")
    rows: dict[str, bytes] = {}
    for _ in range(count):
        parts = []
        for _ in range(2):
            (size,) = _LEN.unpack_from(data, at)
            at += _LEN.size
            if at + size > len(data):
                raise ValueError("row runs past the end")
            parts.append(data[at:at + size])
            at += size
        rows[parts[0].decode("ascii")] = parts[1]
    if at != len(data):
        raise ValueError("bytes after the last row")
    return rows


class Generated:
    """The served dictionaries of one process (thread-safe)."""

    def __init__(self, read: Reader, write: Callable[[], Writer | None]) -> None:
        """``read`` answers a stored artifact of this kind; ``write`` gives the writer
        at the end (``None``: nothing is written)."""
        self._read = read
        self._write = write
        self._lock = threading.Lock()
        self._app = application_digest()
        #: dictionary file -> (its key id, whether the store held it, keyhashes used)
        self._dicts: dict[str, tuple[str, bool, set[str]]] = {}

    def key_of(self, filename: str) -> str:
        import pyopencl
        import pytools

        return stable_hash({"app": self._app, "dict": os.path.basename(filename),
                            "pyopencl": pyopencl.VERSION_TEXT,
                            "pytools": getattr(pytools, "__version__", "")}, 64)

    def install(self) -> None:
        """Serve every pytools persistent dictionary of this process (see the module
        docstring). Nothing is served without a main script to name the application."""
        if not self._app:
            return
        from pytools import persistent_dict as pd

        for cls in (pd.WriteOncePersistentDict, pd.PersistentDict):
            _wrap(cls, self)

    def missed(self, pdict: _Dict, keyhash: str) -> bool:
        """A miss of ``pdict``: its stored rows added, the first time; whether a retry
        can find ``keyhash`` now."""
        filename = pdict.filename
        with self._lock:
            known = self._dicts.get(filename)
            if known is not None:
                known[2].add(keyhash)
                return False
            key = self.key_of(filename)
            self._dicts[filename] = entry = (key, False, {keyhash})
        try:
            data = self._read(key, GENERATED_BUILD_ID)
            rows = decode(data) if data is not None else None
        except (ValueError, struct.error):
            rows = None
        if rows is None:
            return False
        with self._lock:
            self._dicts[filename] = (key, True, entry[2])
        pdict._exec_sql_fn(lambda: pdict.conn.executemany(
            "INSERT OR IGNORE INTO dict VALUES (?, ?)", list(rows.items())))
        return keyhash in rows

    def writes(self, pdict: _Dict) -> bool:
        """Whether this process will store ``pdict``'s rows (the store held none)."""
        entry = self._dicts.get(pdict.filename)
        return entry is not None and not entry[1]

    def used(self, pdict: _Dict, keyhash: str) -> None:
        """A row of ``pdict`` this process found or stored."""
        with self._lock:
            entry = self._dicts.get(pdict.filename)
            if entry is not None:
                entry[2].add(keyhash)

    def close(self) -> None:
        """Store the rows of every dictionary the store did not hold (first writer)."""
        import sqlite3

        with self._lock:
            todo = [(f, k, used) for f, (k, held, used) in self._dicts.items() if not held]
            self._dicts.clear()
        writer = self._write() if todo else None
        if writer is None:
            return
        for filename, key, used in todo:
            try:
                conn = sqlite3.connect(f"file:{filename}?mode=ro", uri=True)
                try:
                    marks = ",".join("?" * len(used))
                    rows = dict(conn.execute(
                        f"SELECT keyhash, key_value FROM dict WHERE keyhash IN ({marks})",
                        sorted(used)).fetchall())
                finally:
                    conn.close()
            except sqlite3.Error:
                continue
            if rows:
                writer(key, GENERATED_BUILD_ID, encode(rows))


def _wrap(cls: type, served: Generated) -> None:
    """``cls.fetch`` and ``cls.store`` noting what is used, and a miss asking the farm."""
    if getattr(vars(cls).get("fetch"), "_farm_generated", False):
        return
    fetch, store = vars(cls)["fetch"], vars(cls)["store"]

    def served_fetch(self: _Dict, key: object) -> object:
        try:
            value = fetch(self, key)
        except KeyError:
            keyhash = self.key_builder(key)
            if not served.missed(self, keyhash):
                raise
            value = fetch(self, key)
        if served.writes(self):  # hashing a key can cost (loopy's): only where needed
            served.used(self, self.key_builder(key))
        return value

    def served_store(self: _Dict, key: object, value: object,
                     _skip_if_present: bool = False) -> None:
        store(self, key, value, _skip_if_present)
        if served.writes(self):
            served.used(self, self.key_builder(key))

    served_fetch._farm_generated = True  # type: ignore[attr-defined]
    setattr(cls, "fetch", served_fetch)  # noqa: B010 - a class of another library
    setattr(cls, "store", served_store)  # noqa: B010
