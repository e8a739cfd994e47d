"""The embedded artifact store: one SQLite file per environment.

Layout (format ``kernel-farm-store`` version 1)::

    meta(k PRIMARY KEY, v)                      'format' -> 'kernel-farm-store', 'version' -> '1'
    artifacts(namespace, id_hash, build_id,     PRIMARY KEY (namespace, id_hash, build_id)
              digest, size, meta JSON, binary)
    sources(namespace, source_hash,             PRIMARY KEY (namespace, source_hash)
            id_hash, build_id)
    quarantine(namespace, id_hash, build_id,    artifacts proven bad on their own device:
               digest, reason, at, meta,        PRIMARY KEY (namespace, id_hash, build_id,
               binary)                          digest); made when first needed, so
                                                files of earlier farms read as they were
    blobs(digest PRIMARY KEY, size, data)       program sources and headers by SHA-256
                                                (added to older files when opened: a
                                                reader that knows no blobs ignores it)

The namespace is a column, never part of a path. Opening a file that is not a
kernel-farm store (or of another format version) raises :class:`ForeignStoreError`
without writing to it. A damaged file (truncated, zeroed pages) is a
:class:`StoreError`, never a ``sqlite3`` traceback: a file not yet in WAL mode is
integrity-checked before the switch to WAL rewrites its header, and every later query
turns a database error into one line. A row that does not validate is a miss (an
artifact) or skipped with a warning (a listing).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote

from pydantic import ValidationError

from farm.core.errors import ForeignStoreError, StoreError
from farm.core.hashing import sha256_hex
from farm.core.keys import Namespace
from farm.core.model import Artifact, ArtifactMeta, Key, Lowered
from farm.core.sqlite_wal import enable_wal
from farm.store.base import (
    ArtifactStore,
    PutResult,
    Quarantined,
    checked,
    checked_blob,
    decide_put,
    index_hash,
    iter_chunks,
    log_refused,
    quarantine_reason,
)
from farm.store.sqlite_file import BLOBS, FORMAT, ROW, VERSION, connect, create, initialise

if TYPE_CHECKING:
    from farm.store.url import Opening, StoreURL

log = logging.getLogger(__name__)

_QUARANTINE = """
CREATE TABLE IF NOT EXISTS quarantine (
    namespace TEXT NOT NULL, id_hash TEXT NOT NULL, build_id TEXT NOT NULL,
    digest TEXT NOT NULL, reason TEXT NOT NULL, at TEXT NOT NULL, meta TEXT NOT NULL,
    binary BLOB NOT NULL, PRIMARY KEY (namespace, id_hash, build_id, digest));
"""


class SQLiteStore(ArtifactStore):
    """Thread-safe through one connection and a lock; WAL lets other processes read."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._lock = threading.RLock()
        self._conn = self._open()

    @classmethod
    def from_url(cls, url: StoreURL, opening: Opening) -> SQLiteStore:
        """``sqlite:///<absolute path>`` (odd characters percent-encoded)."""
        if url.parts.netloc or not url.parts.path.startswith("/") or url.parts.query:
            raise url.error("not sqlite:///<absolute path>")
        return cls(Path(unquote(url.parts.path)))

    @property
    def location(self) -> str:
        return str(self.path)

    def _open(self) -> sqlite3.Connection:
        path = self.path
        if path.exists() and not path.is_file():
            raise ForeignStoreError(f"{path}: not a kernel-farm store (not a file)")
        if not path.exists():
            create(path)  # whole before anyone opens it (see sqlite_file.create)
        fresh = not path.exists() or path.stat().st_size == 0
        header = b""
        if not fresh:
            try:
                with open(path, "rb") as fh:
                    header = fh.read(100)
            except OSError as exc:
                raise StoreError(f"{path}: cannot read the store ({exc.strerror})") from None
            if header[:16] != b"SQLite format 3\x00":
                raise ForeignStoreError(f"{path}: not a kernel-farm store (not SQLite)")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{path.parent}: cannot create the store's folder "
                             f"({exc.strerror})") from None
        if not os.access(path if not fresh else path.parent, os.W_OK):
            raise StoreError(f"{path if not fresh else path.parent}: not writable (a "
                             "read-only FARM_HOME?); the store needs write access")
        conn: sqlite3.Connection | None = None
        try:
            conn = connect(path)
            if fresh:
                initialise(conn)
            else:
                self._check_format(conn)
                # bytes 18-19 are 2 in WAL mode: the switch below rewrites a file in
                # another mode, so check first that it is whole
                if header[18:20] != b"\x02\x02":
                    self._check_integrity(conn)
                enable_wal(conn)
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.executescript(BLOBS)
        except (ForeignStoreError, StoreError):
            if conn is not None:
                conn.close()
            raise
        except sqlite3.OperationalError as exc:
            if conn is not None:
                conn.close()
            raise StoreError(f"{path}: cannot open the store ({exc})") from None
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
            if conn is not None:
                conn.close()
            raise ForeignStoreError(f"{path}: not a kernel-farm store ({exc})") from None
        return conn

    def _check_integrity(self, conn: sqlite3.Connection) -> None:
        try:
            rows = conn.execute("PRAGMA quick_check(1)").fetchall()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: the store is damaged ({exc}); move it aside "
                             "and rebuild, or restore it") from None
        if rows != [("ok",)]:
            what = " ".join(str(rows[0][0] if rows else "no answer").split())
            raise StoreError(f"{self.path}: the store is damaged ({what}); move it "
                             "aside and rebuild, or restore it")

    @contextmanager
    def _guard(self, doing: str) -> Iterator[None]:
        """One line for a database error (a damaged or vanished file, a full disk)."""
        try:
            yield
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # see _check_format
            raise StoreError(f"store {self.path}: {doing} failed ({exc})") from None

    def _check_format(self, conn: sqlite3.Connection) -> None:
        try:
            rows = dict(conn.execute("SELECT k, v FROM meta").fetchall())
        except (sqlite3.DatabaseError, UnicodeDecodeError):  # the latter: a damaged schema
            raise ForeignStoreError(f"{self.path}: not a kernel-farm store "
                                    "(no meta table)") from None
        if rows.get("format") != FORMAT:
            raise ForeignStoreError(f"{self.path}: not a kernel-farm store")
        if rows.get("version") != VERSION:
            raise ForeignStoreError(f"{self.path}: store format version {rows.get('version')}"
                                    f", this farm reads version {VERSION}")

    # -- reads -----------------------------------------------------------------------------
    def _read(self, ns: Namespace, key: Key) -> Artifact | bool | None:
        """The artifact, ``None`` if absent, ``False`` if present but unreadable."""
        with self._lock, self._guard("reading an artifact"):
            row = self._conn.execute(ROW, (str(ns), key.id_hash, key.build_id)).fetchone()
        if row is None:
            return None
        try:
            meta = ArtifactMeta.model_validate_json(row[0])
            return Artifact(meta=meta, binary=bytes(row[1]))
        except (ValidationError, TypeError, ValueError):
            return False

    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        found = self._read(ns, key)
        if found is None:
            return None
        return checked(self, ns, key, found if isinstance(found, Artifact) else None)

    def existing(self, ns: Namespace, keys: Iterable[Key]) -> set[Key]:
        wanted = list(keys)
        found: set[Key] = set()
        with self._lock, self._guard("listing artifacts"):
            for chunk in iter_chunks(wanted, 400):
                marks = ",".join("(?,?)" for _ in chunk)
                params: list[str] = [str(ns)]
                for k in chunk:
                    params += [k.id_hash, k.build_id]
                rows = self._conn.execute(
                    f"SELECT id_hash, build_id FROM artifacts WHERE namespace=? AND "
                    f"(id_hash, build_id) IN (VALUES {marks})", params).fetchall()
                found.update(k for k in map(_key_of, rows) if k is not None)
        return found

    def find_source(self, ns: Namespace, source_hash: str) -> Key | None:
        with self._lock, self._guard("reading the source index"):
            row = self._conn.execute(
                "SELECT id_hash, build_id FROM sources WHERE namespace=? AND source_hash=?",
                (str(ns), source_hash)).fetchone()
        return _key_of(row) if row else None

    def keys(self, ns: Namespace) -> Iterator[Key]:
        with self._lock, self._guard("listing artifacts"):
            rows = self._conn.execute(
                "SELECT id_hash, build_id FROM artifacts WHERE namespace=? "
                "ORDER BY id_hash, build_id", (str(ns),)).fetchall()
        return iter([k for k in map(_key_of, rows) if k is not None])

    def namespaces(self) -> list[Namespace]:
        with self._lock, self._guard("listing namespaces"):
            rows = self._conn.execute(
                "SELECT DISTINCT namespace FROM artifacts ORDER BY namespace").fetchall()
        found = []
        for (text,) in rows:
            try:
                found.append(Namespace.parse(text))
            except (ValueError, TypeError):
                log.warning("store %s: row of namespace %.60r is not a namespace; skipped",
                            self.path, text)
        return found

    # -- writes ----------------------------------------------------------------------------
    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        meta = artifact.meta
        key = meta.key
        source_hash = index_hash(artifact, source)
        with self._lock, self._guard("writing an artifact"):
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                existing = self._read(ns, key)
                decision = decide_put(existing if isinstance(existing, Artifact) else None,
                                      artifact)
                if decision is None:
                    if existing is not None:
                        self.stats.bump("repaired")
                    self._conn.execute(
                        "INSERT OR REPLACE INTO artifacts VALUES (?,?,?,?,?,?,?)",
                        (str(ns), key.id_hash, key.build_id, meta.digest, meta.size,
                         meta.model_dump_json(), artifact.binary))
                if source_hash is not None and decision in (None, PutResult.SAME):
                    self._conn.execute(
                        "INSERT OR REPLACE INTO sources VALUES (?,?,?,?)",
                        (str(ns), source_hash, key.id_hash, key.build_id))
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
        if decision is PutResult.REFUSED:
            log_refused(self, ns, key)
            return decision
        return decision or PutResult.STORED

    def delete(self, ns: Namespace, key: Key) -> None:
        with self._lock, self._guard("deleting an artifact"):
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute(
                    "DELETE FROM artifacts WHERE namespace=? AND id_hash=? AND build_id=?",
                    (str(ns), key.id_hash, key.build_id))
                self._conn.execute(
                    "DELETE FROM sources WHERE namespace=? AND id_hash=? AND build_id=?",
                    (str(ns), key.id_hash, key.build_id))
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def quarantine(self, ns: Namespace, key: Key, digest: str, reason: str) -> bool:
        with self._lock, self._guard("quarantining an artifact"):
            self._conn.execute(_QUARANTINE)
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._conn.execute(
                    "SELECT meta, binary FROM artifacts WHERE namespace=? AND id_hash=? "
                    "AND build_id=? AND digest=?",
                    (str(ns), key.id_hash, key.build_id, digest)).fetchone()
                if row is not None:
                    self._conn.execute(
                        "INSERT OR REPLACE INTO quarantine VALUES (?,?,?,?,?,?,?,?)",
                        (str(ns), key.id_hash, key.build_id, digest,
                         quarantine_reason(reason), dt.datetime.now(dt.UTC).isoformat(),
                         row[0], row[1]))
                    self._conn.execute(
                        "DELETE FROM artifacts WHERE namespace=? AND id_hash=? AND "
                        "build_id=?", (str(ns), key.id_hash, key.build_id))
                    self._conn.execute(
                        "DELETE FROM sources WHERE namespace=? AND id_hash=? AND "
                        "build_id=?", (str(ns), key.id_hash, key.build_id))
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
        if row is not None:
            log.warning("store %s: %s/%s quarantined: %s", self.path, ns, key, reason)
        return row is not None

    def quarantined(self, ns: Namespace) -> list[Quarantined]:
        with self._lock, self._guard("reading the quarantine"):
            if self._conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND "
                                  "name='quarantine'").fetchone() is None:
                return []
            rows = self._conn.execute(
                "SELECT reason, at, meta, binary FROM quarantine WHERE namespace=? "
                "ORDER BY at", (str(ns),)).fetchall()
        found = []
        for reason, at, meta, binary in rows:
            try:
                artifact = Artifact(meta=ArtifactMeta.model_validate_json(meta),
                                    binary=bytes(binary))
                found.append(Quarantined(key=artifact.meta.key, artifact=artifact,
                                         reason=str(reason),
                                         at=dt.datetime.fromisoformat(str(at))))
            except (ValidationError, TypeError, ValueError):
                log.warning("store %s: a quarantine row does not read; skipped", self.path)
        return found

    # -- blobs -------------------------------------------------------------------------------
    def get_blob(self, digest: str) -> bytes | None:
        with self._lock, self._guard("reading a blob"):
            row = self._conn.execute("SELECT data FROM blobs WHERE digest=?",
                                     (digest,)).fetchone()
        return checked_blob(self, digest, bytes(row[0]) if row else None)

    def put_blob(self, data: bytes) -> str:
        digest = sha256_hex(data)
        with self._lock, self._guard("writing a blob"):
            row = self._conn.execute("SELECT data FROM blobs WHERE digest=?",
                                     (digest,)).fetchone()
            if row is None or sha256_hex(bytes(row[0])) != digest:  # absent, or repair
                self._conn.execute("INSERT OR REPLACE INTO blobs VALUES (?,?,?)",
                                   (digest, len(data), bytes(data)))
        return digest

    def existing_blobs(self, digests: Iterable[str]) -> set[str]:
        wanted = list(digests)
        found: set[str] = set()
        with self._lock, self._guard("listing blobs"):
            for i in range(0, len(wanted), 400):
                chunk = wanted[i:i + 400]
                rows = self._conn.execute(
                    f"SELECT digest FROM blobs WHERE digest IN ({','.join('?' * len(chunk))})",
                    chunk).fetchall()
                found.update(str(r[0]) for r in rows)
        return found

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _key_of(row: tuple[object, ...]) -> Key | None:
    """The key a row names; ``None`` (logged) for a row that is not one."""
    try:
        return Key(id_hash=row[0], build_id=row[1])
    except (ValidationError, TypeError):
        log.warning("store: row %.80r does not name a key; skipped", row)
        return None
