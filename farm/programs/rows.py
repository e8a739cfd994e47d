"""Stored artifacts as a served process reads them before it needs the program server:
rows of the node's local tier, then objects of MinIO (a signed GET), each checked
against its key, family, size and digest; and what MinIO served kept in the local tier.

Standard library only: the served quick path (:mod:`farm.programs.quick`) and the prover
ahead of an application (:mod:`farm.programs.ahead`) read with it before anything of
pydantic, the settings or the MinIO SDK is imported. What it does not read as expected
(a setting it does not parse, a store file it does not know, an answer MinIO gives that
it does not handle) it leaves to the program server: :attr:`Config.declined`, or a miss.
"""

from __future__ import annotations

import json
import os
import threading
from collections import namedtuple

from farm.core.hashing import sha256_hex
from farm.core.keys import Namespace, artifact_object

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import queue
    import sqlite3
    from typing import Any

    from farm.core.outage import Waiter
    from farm.store.s3_get import S3Reader

#: seconds a store outage is waited out inside an application (the farm's default of a
#: minute would stall the application; past this its programs are built the plain way)
APP_OUTAGE_LIMIT_S = 2.0
#: the longest one request to the store may take inside an application: half the wait,
#: so that a frozen store (no answer at all) is given up within it
APP_ATTEMPT_S = APP_OUTAGE_LIMIT_S / 2
#: seconds the process's end waits for the local tier to take what MinIO served
KEEP_S = 10.0

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

#: a key as :func:`farm.core.keys.artifact_object` reads one, without the pydantic model
_Key = namedtuple("_Key", "id_hash build_id")
#: one stored artifact as read: its metadata (JSON text), its bytes, whether MinIO served it
Row = namedtuple("Row", "meta binary remote")


class Unchecked(Exception):
    """A stored row that is not what its key says (the server reads it, and treats it as
    its rules say)."""


class Unavailable(Exception):
    """The store did not answer within :data:`APP_OUTAGE_LIMIT_S`; ``cause`` says why."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def app_waiter(what: str) -> Waiter:
    """The outage waiter of a store inside an application: silent (the one line is the
    server's), and naming where the store is configured."""
    from farm.core.outage import Waiter

    waiter = Waiter(what, APP_OUTAGE_LIMIT_S, is_down=lambda exc: isinstance(exc, OSError),
                    say=lambda line: None, attempt_s=APP_ATTEMPT_S)
    waiter.limit_setting = "FARM_MINIO_ENDPOINT"
    return waiter


class Config:
    """The settings a served process reads before the server (``FARM_*``), or why it
    leaves builds to the server (``declined``: a value it does not parse is the server's
    to report)."""

    def __init__(self, env: dict[str, str]) -> None:
        from farm.core.keys import DEFAULT_ENVIRONMENT, STORE_FILE
        from farm.core.runenv import home_of

        self.declined = ""
        #: the node's farm home (its local tier's folder, its proof book)
        self.home = home_of(env)
        environment = env.get("FARM_ENVIRONMENT") or DEFAULT_ENVIRONMENT
        if "/" in environment or environment in (".", ".."):
            self.declined = "FARM_ENVIRONMENT"
        self.store_path = os.path.join(self.home, "envs", environment, STORE_FILE)
        self.pocl_ready = self._flag(env, "FARM_POCL_READY", True)
        #: the public key every artifact read must be signed by (FARM_VERIFY_KEY, else the
        #: public half of FARM_SIGNING_KEY, as farm.store.signing verifies)
        self.verify_key: bytes | None = None
        self.signs = bool(env.get("FARM_SIGNING_KEY"))
        verify = env.get("FARM_VERIFY_KEY") or ""
        if verify or self.signs:
            from farm.core.signatures import public_of, raw_key

            try:
                self.verify_key = raw_key(verify) if verify else public_of(
                    raw_key(env.get("FARM_SIGNING_KEY", "")))
            except ValueError:
                self.declined = "FARM_VERIFY_KEY"
        #: FARM_GENERATED_CODE: whose generated code (pickles: Python code) is served
        self.generated_code = env.get("FARM_GENERATED_CODE", "").strip().lower() or "signed"
        if self.generated_code not in ("signed", "any", "off"):
            self.declined = "FARM_GENERATED_CODE"
        #: (host, TLS, access key, secret key, bucket, region) of FARM_MINIO_*
        self.minio: tuple[str, bool, str, str, str, str] | None = None
        endpoint = env.get("FARM_MINIO_ENDPOINT")
        if endpoint:
            from farm.store.s3_request import parse_endpoint

            access = env.get("FARM_MINIO_ACCESS_KEY")
            secret = env.get("FARM_MINIO_SECRET_KEY")
            bucket = env.get("FARM_MINIO_BUCKET")
            try:
                host, secure = parse_endpoint(
                    endpoint, self._flag(env, "FARM_MINIO_SECURE", False))
            except ValueError:
                host, secure = "", False
            if not (host and access and secret):
                self.declined = "FARM_MINIO_*"
            else:
                from farm.core.keys import DEFAULT_BUCKET
                from farm.store.s3_request import REGION

                # "" (ask the server) is the SDK's: a GET signed for MinIO's default
                # region that the server refuses is left to it (S3Declined)
                self.minio = (host, secure, access, secret, bucket or DEFAULT_BUCKET,
                              env.get("FARM_MINIO_REGION") or REGION)

    @property
    def reads_generated(self) -> bool:
        """Whether generated code from the store runs here (docs/SECURITY.md): from a store
        whose every artifact is signed by a trusted key, or from any with ``any``."""
        return self.generated_code == "any" or (
            self.generated_code == "signed" and self.verify_key is not None)

    @property
    def writes_generated(self) -> bool:
        """Whether this process stores the generated code its application used: signed,
        or unsigned with ``any``."""
        return self.generated_code == "any" or (self.generated_code == "signed"
                                                and self.signs)

    def _flag(self, env: dict[str, str], name: str, default: bool) -> bool:
        value = env.get(name, "").strip().lower()
        if not value:
            return default
        if value not in _TRUE + _FALSE:
            self.declined = name
        return value in _TRUE


class Rows:
    """The local tier and MinIO of one process, read as rows (thread-safe)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._local: sqlite3.Connection | None = None
        self._local_tried = False
        self._remote: tuple[S3Reader, Waiter] | None = None
        #: rows to keep in the local tier, and the thread that writes them
        self._keeping: queue.SimpleQueue[tuple[str, str, str, str, str, bytes] | None]
        self._keeper: threading.Thread | None = None

    def read(self, fingerprint: str, id_hash: str, build_id: str, family: str
             ) -> tuple[Row, dict[str, Any]] | None:
        """The artifact ``id_hash``/``build_id`` of ``family`` in ``fingerprint``'s
        namespace from the local tier, else MinIO, and its metadata, checked
        (:func:`checked`); ``None`` when neither holds one; :class:`Unchecked` for one that
        does not check; :class:`Unavailable` when MinIO did not answer."""
        ns = str(Namespace.for_fingerprint(fingerprint))
        found = self.read_local(ns, id_hash, build_id)
        remote = found is None
        if remote and self.config.minio is not None:
            found = self.read_remote(ns, id_hash, build_id)
        if found is None:
            return None
        meta = checked(id_hash, found[0], found[1], family, build_id)
        if meta is None or not self._signed(ns, f"{id_hash}.{build_id}", family, meta):
            raise Unchecked(f"{ns}/{id_hash}")
        text = found[0] if isinstance(found[0], str) else found[0].decode("utf-8")
        return Row(text, found[1], remote), meta

    def _signed(self, ns: str, key: str, family: str, meta: dict[str, Any]) -> bool:
        """Whether ``meta`` is signed as the node requires (:mod:`farm.store.signing`:
        version 2, by the verify key, for this namespace); always, with no key."""
        if self.config.verify_key is None:
            return True
        from farm.core.signatures import SIGNATURE_V2, signed_message, valid

        signature = meta.get("signature")
        return isinstance(signature, str) and signature.startswith(SIGNATURE_V2) and valid(
            self.config.verify_key, signature[len(SIGNATURE_V2):],
            signed_message(ns, key, family, meta["digest"], meta["size"]))

    def read_local(self, ns: str, id_hash: str, build_id: str
                   ) -> tuple[str | bytes, bytes] | None:
        """(metadata JSON, binary) of an artifact in the node's local tier, if there."""
        local = self._local_tier()
        if local is None:
            return None
        from farm.store.sqlite_file import read_row

        with self._lock:
            return read_row(local, ns, id_hash, build_id)

    def read_remote(self, ns: str, id_hash: str, build_id: str
                    ) -> tuple[str | bytes, bytes] | None:
        """(metadata JSON, binary) of an artifact in MinIO, if there (and whole)."""
        from farm.core.outage import OutageError
        from farm.store.frames import split_artifact
        from farm.store.s3_get import S3Declined

        reader, waiter = self._remote_reader()
        name = artifact_object(Namespace.parse(ns), _Key(id_hash, build_id))
        try:
            data = waiter.call(lambda: reader.get(name))
        except S3Declined:
            return None  # an answer the SDK handles: the server reads it
        except OutageError as exc:
            raise Unavailable(exc) from None
        return None if data is None else split_artifact(data)

    def _local_tier(self) -> sqlite3.Connection | None:
        """The node's local tier, if it is a store this reader reads (see
        :func:`farm.store.sqlite_file.open_existing`); one not there yet is looked for
        again at the next read (a ``stat``: the prover ahead makes it meanwhile)."""
        with self._lock:
            if not self._local_tried:
                from pathlib import Path

                from farm.store.sqlite_file import open_existing

                path = self.config.store_path
                self._local_tried = os.path.exists(path)
                self._local = open_existing(Path(path)) if self._local_tried else None
            return self._local

    def _remote_reader(self) -> tuple[S3Reader, Waiter]:
        with self._lock:
            if self._remote is None:
                from farm.store.s3_get import S3Reader

                assert self.config.minio is not None
                host, secure, access, secret, bucket, region = self.config.minio
                self._remote = (S3Reader(host, secure, access, secret, bucket,
                                         APP_ATTEMPT_S, region), app_waiter(f"MinIO at {host}"))
            return self._remote

    def keep(self, fingerprint: str, id_hash: str, build_id: str, row: Row) -> None:
        """Keep what MinIO served, and the device loaded, in the local tier (a cache:
        what cannot be kept there is read from MinIO again next time), on a thread of
        its own: a fresh node makes its store file then (WAL, an fsync), and SQLite lets
        the application run meanwhile."""
        import queue

        with self._lock:
            if self._keeper is None:
                self._keeping = queue.SimpleQueue()
                self._keeper = threading.Thread(target=self._keep_all, daemon=True,
                                                 name="kernel-farm local tier")
                self._keeper.start()
        self._keeping.put((str(Namespace.for_fingerprint(fingerprint)), id_hash, build_id,
                           sha256_hex(row.binary), row.meta, row.binary))

    def _keep_all(self) -> None:
        import sqlite3

        from farm.store.sqlite_file import insert_row

        while (row := self._keeping.get()) is not None:
            local = self._local_tier()
            with self._lock:
                if local is None:
                    from pathlib import Path

                    from farm.store.sqlite_file import create, open_existing

                    path = Path(self.config.store_path)
                    local = self._local = open_existing(path) if create(path) else None
                if local is None:
                    continue
                try:
                    insert_row(local, *row)
                except sqlite3.Error:
                    pass

    def close(self) -> None:
        """What is left to keep in the local tier (the process ends)."""
        keeper = self._keeper
        if keeper is not None:
            self._keeping.put(None)
            keeper.join(KEEP_S)


def checked(key: str, meta_json: str | bytes, binary: bytes, family: str, build_id: str
            ) -> dict[str, Any] | None:
    """The metadata of a stored artifact that says it is ``key``'s (and ``build_id``'s),
    of ``family``, of exactly these bytes; ``None`` otherwise. What the bytes are, and
    whether this node may load them, is the caller's to check (for a program: its body,
    and the node's proof book)."""
    try:
        meta = json.loads(meta_json)
        stored_key = meta["key"] if isinstance(meta, dict) else None
        if not (isinstance(stored_key, dict) and stored_key.get("id_hash") == key
                and stored_key.get("build_id") == build_id
                and meta.get("family") == family
                and meta.get("size") == len(binary)
                and meta.get("digest") == sha256_hex(binary)):
            return None
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    return meta
