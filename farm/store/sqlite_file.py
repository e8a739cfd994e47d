"""The embedded store's file, as :class:`farm.store.sqlite.SQLiteStore` lays it out: its
schema, and the reads and writes of one artifact row that need no models.

:class:`~farm.store.sqlite.SQLiteStore` is the store (first writer wins, repairs,
quarantine, integrity checks); this module is what it and a served application's quick
path (:mod:`farm.programs.quick`) share: the layout, made once here, and a row read or
written as bytes. The quick path uses it only on a file that is a well-formed store in
WAL mode (:func:`open_existing`) or one it makes from nothing (:func:`create`); anything
else it leaves to ``SQLiteStore``.
"""

from __future__ import annotations

import os
import sqlite3

from farm.core.sqlite_wal import enable_wal

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

FORMAT = "kernel-farm-store"
VERSION = "1"

#: also run on older files when they are opened (CREATE ... IF NOT EXISTS)
BLOBS = """
CREATE TABLE IF NOT EXISTS blobs (
    digest TEXT PRIMARY KEY, size INTEGER NOT NULL, data BLOB NOT NULL);
"""
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS artifacts (
    namespace TEXT NOT NULL, id_hash TEXT NOT NULL, build_id TEXT NOT NULL,
    digest TEXT NOT NULL, size INTEGER NOT NULL, meta TEXT NOT NULL, binary BLOB NOT NULL,
    PRIMARY KEY (namespace, id_hash, build_id));
CREATE TABLE IF NOT EXISTS sources (
    namespace TEXT NOT NULL, source_hash TEXT NOT NULL,
    id_hash TEXT NOT NULL, build_id TEXT NOT NULL,
    PRIMARY KEY (namespace, source_hash));
""" + BLOBS

#: one artifact's metadata (JSON) and binary
ROW = ("SELECT meta, binary FROM artifacts WHERE namespace=? AND id_hash=? "
       "AND build_id=?")


def connect(path: Path | str) -> sqlite3.Connection:
    """A connection as the store uses one (autocommit, shared between threads)."""
    conn = sqlite3.connect(path, check_same_thread=False, timeout=30, isolation_level=None)
    # damaged text is not UTF-8: read it as U+FFFD, which then fails validation
    conn.text_factory = lambda raw: raw.decode("utf-8", "replace")
    return conn


def initialise(conn: sqlite3.Connection) -> None:
    """Lay a new, empty file out as a store (WAL, the schema, the format rows)."""
    enable_wal(conn)
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.executescript(SCHEMA)
    conn.executemany("INSERT OR IGNORE INTO meta VALUES (?, ?)",
                     [("format", FORMAT), ("version", VERSION)])


def open_existing(path: Path) -> sqlite3.Connection | None:
    """A connection to ``path`` if it is a store of this format already in WAL mode;
    ``None`` for anything else (absent, another file, a file not yet switched to WAL,
    which ``SQLiteStore`` checks for damage first)."""
    try:
        with open(path, "rb") as fh:
            header = fh.read(100)
    except OSError:
        return None
    if header[:16] != b"SQLite format 3\x00" or header[18:20] != b"\x02\x02":
        return None
    conn: sqlite3.Connection | None = None
    try:
        conn = connect(path)
        rows = dict(conn.execute("SELECT k, v FROM meta").fetchall())
        if rows.get("format") == FORMAT and rows.get("version") == VERSION:
            conn.execute("PRAGMA synchronous=NORMAL")
            return conn
    except (sqlite3.Error, UnicodeDecodeError, ValueError):
        pass
    if conn is not None:
        conn.close()
    return None


def create(path: Path) -> bool:
    """Make a new store at ``path`` (and its folder) if there is no file there yet; False
    when it cannot be made. Made whole under a name of its own and then linked into
    place, so that processes starting together (a pool's) never open a file another is
    still laying out (it would read as "not a kernel-farm store")."""
    try:
        os.makedirs(path.parent, exist_ok=True)
    except OSError:
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.new")
    try:
        conn = connect(tmp)
        try:
            initialise(conn)
        finally:
            conn.close()  # the last connection: the file is whole, its WAL folded in
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process made it first: theirs is the store
    except (OSError, sqlite3.Error):
        return False
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + "-wal"),
                         tmp.with_name(tmp.name + "-shm")):
            try:
                os.unlink(leftover)
            except OSError:
                pass
    return True


def read_row(conn: sqlite3.Connection, ns: str, id_hash: str, build_id: str
             ) -> tuple[str, bytes] | None:
    """(metadata JSON, binary) of one artifact; ``None`` when there is none."""
    row = conn.execute(ROW, (ns, id_hash, build_id)).fetchone()
    return None if row is None else (row[0], bytes(row[1]))


def insert_row(conn: sqlite3.Connection, ns: str, id_hash: str, build_id: str,
               digest: str, meta: str, binary: bytes) -> None:
    """Keep an artifact already verified against ``digest`` (``meta``: its metadata JSON
    as the store writes it), unless the key holds one already (first writer wins)."""
    conn.execute("INSERT OR IGNORE INTO artifacts VALUES (?,?,?,?,?,?,?)",
                 (ns, id_hash, build_id, digest, len(binary), meta, binary))
