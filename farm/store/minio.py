"""The cluster artifact store: one MinIO (S3) bucket, objects laid out by :mod:`farm.core.keys`.

Object format (``kernel-farm-artifact`` version 1)::

    b"KFARTIF1"                magic: format and version, 8 bytes
    uint32, big endian         length N of the metadata JSON
    N bytes                    ArtifactMeta as JSON (key, digest, size, build log, ...)
    the rest                   the binary

Why a frame inside the object: S3 user metadata is limited to about 2 KiB, and a build
log alone can be longer, so the full metadata travels with the binary and one GET reads
both. The short fields (digest, size, build id, source hash, family, host, worker, work
time) are *also* written as user metadata (``x-amz-meta-farm-*``) so that ``mc stat`` and
listings show them, and so that :meth:`MinioStore.delete` can find the source-index entry
with a HEAD request. The frame is the truth; a header digest that disagrees with it marks
the object corrupt. A frame that does not parse, a size or digest mismatch, or metadata
naming another key is corrupt: counted in ``stats.corrupt`` and answered as a miss.

First writer wins through conditional writes: ``PUT`` with ``If-None-Match: *``. A 412
means the key is taken: the existing object is read; the same digest is SAME, a valid
different value is REFUSED (counted, logged at info), a corrupt one is overwritten with
``If-Match: <its etag>`` so that a concurrent repair or write is never clobbered. The
Python SDK (7.2) turns every extra header of ``put_object`` into user metadata, so the
conditional writes go through ``Minio._put_object``, the SDK's own single-part upload,
which sends headers as given (checked when the store is made).

Rekey re-encodes rather than copies server-side: the frame embeds the key, so a byte
copy would name the wrong key, and MinIO ignores ``If-None-Match`` on CopyObject (tried
against the test server: it overwrote an existing destination), so a copy could not keep
first-writer-wins. The source has to be downloaded and verified anyway before it is
reused, so the inherited :meth:`ArtifactStore.rekey` (verified get, conditional put,
delete for a move) costs one upload more than a copy and keeps every rule.

Transient failures (connection errors, 5xx, ``SlowDown``) are retried with exponential
backoff by tenacity; the SDK's own urllib3 retries are switched off so the two do not
multiply. A store made from settings waits out an outage of up to ``FARM_OUTAGE_LIMIT``
seconds (one warning line when it starts, one when it ends; see :mod:`farm.core.outage`)
instead of a fixed number of attempts. Other failures, and transient ones that outlast
the retries, raise :class:`~farm.core.errors.StoreError` naming the store's location, never
its credentials.

The source-index entry is written *before* the artifact (and again when a put finds the
same artifact already there): a reply lost after the artifact was written, or a process
killed between the two writes, can then never leave an artifact unindexed. An entry that
points at a key not (yet) stored is harmless: readers verify what they find.
"""

from __future__ import annotations

import io
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import quote, urlsplit

import certifi
import urllib3
from minio import Minio
from minio.datatypes import Object
from minio.error import InvalidResponseError, S3Error, ServerError
from pydantic import ValidationError
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from farm.core.errors import SettingsError, StoreError
from farm.core.keys import (
    NAMESPACE_LEVELS,
    Namespace,
    artifact_object,
    artifacts_prefix,
    key_from_artifact_object,
    namespace_from_prefix,
    source_object,
)
from farm.core.model import Artifact, ArtifactMeta, Key, Lowered
from farm.core.outage import OutageError, Waiter
from farm.core.settings import Settings
from farm.store.base import (
    PutResult,
    checked,
    decide_put,
    index_hash,
    log_refused,
)
from farm.store.minio_blobs import BlobObjects

log = logging.getLogger(__name__)

T = TypeVar("T")

MAGIC = b"KFARTIF1"
_LEN = struct.Struct(">I")
_HEADER = len(MAGIC) + _LEN.size

#: user-metadata field names (sent as ``x-amz-meta-<name>``)
_META_PREFIX = "x-amz-meta-"
_M_DIGEST = "farm-digest"
_M_SIZE = "farm-size"
_M_BUILD = "farm-build-id"
_M_SOURCE = "farm-source-hash"
_M_FAMILY = "farm-family"
_M_HOST = "farm-host"
_M_WORKER = "farm-worker"
_M_WORK = "farm-work-s"
_M_FORMAT = "farm-format"
#: longest free-text header value; keeps the headers far below S3's 2 KiB total
_MAX_HEADER_TEXT = 160

#: S3 error codes that mean "try again", whatever the HTTP status
_TRANSIENT_CODES = frozenset({
    "SlowDown", "SlowDownRead", "SlowDownWrite", "InternalError", "ServiceUnavailable",
    "RequestTimeout", "OperationTimedOut", "XMinioServerNotInitialized",
    "XMinioReadQuorum", "XMinioWriteQuorum",
})
_BUCKET_TAKEN = frozenset({"BucketAlreadyOwnedByYou", "BucketAlreadyExists"})
#: rounds of (conditional write, read what is there) before a put gives up
_MAX_PUT_ROUNDS = 8


# -- object format ---------------------------------------------------------------------------
def encode_artifact(artifact: Artifact) -> bytes:
    """The object body: magic, length-prefixed metadata JSON, binary."""
    meta = artifact.meta.model_dump_json().encode("utf-8")
    return MAGIC + _LEN.pack(len(meta)) + meta + artifact.binary


def decode_artifact(data: bytes) -> Artifact | None:
    """Inverse of :func:`encode_artifact`; ``None`` for anything that is not a whole,
    well-formed frame (verification of the digest is the caller's)."""
    if len(data) < _HEADER or not data.startswith(MAGIC):
        return None
    (length,) = _LEN.unpack_from(data, len(MAGIC))
    end = _HEADER + length
    if end > len(data):
        return None
    try:
        meta = ArtifactMeta.model_validate_json(data[_HEADER:end])
    except ValidationError:
        return None
    return Artifact(meta=meta, binary=data[end:])


def _header_text(value: str) -> str:
    """S3 header values must be printable US-ASCII: percent-encode the rest, cut it short."""
    return quote(value, safe=" !#$&'()*+,-./:;<=>?@[]^_`{|}~")[:_MAX_HEADER_TEXT]


def _user_metadata(artifact: Artifact) -> dict[str, str]:
    meta = artifact.meta
    fields = {
        _M_FORMAT: MAGIC.decode("ascii"),
        _M_DIGEST: meta.digest,
        _M_SIZE: str(meta.size),
        _M_BUILD: meta.key.build_id,
        _M_SOURCE: _header_text(meta.source_hash),
        _M_FAMILY: _header_text(meta.family),
        _M_HOST: _header_text(meta.host),
        _M_WORKER: _header_text(meta.worker),
        _M_WORK: f"{meta.work_s:.6f}",
    }
    return {_META_PREFIX + k: v for k, v in fields.items()}


# -- transient failures ----------------------------------------------------------------------
def is_transient(exc: BaseException) -> bool:
    """Whether a failed request is worth repeating: the network, 5xx, or throttling.

    A 4xx (access denied, a missing bucket, a failed precondition) will fail the same way
    again, so it is not retried.
    """
    if isinstance(exc, S3Error):
        status = getattr(exc.response, "status", 0) or 0
        return exc.code in _TRANSIENT_CODES or status >= 500
    if isinstance(exc, ServerError):
        return exc.status_code >= 500
    if isinstance(exc, InvalidResponseError):  # a non-XML answer, e.g. a proxy's 502 page
        return int(getattr(exc, "_code", 0) or 0) >= 500
    return isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError)


def _describe(exc: BaseException) -> str:
    """One line about a failure, without request signatures or credentials."""
    if isinstance(exc, S3Error):
        return f"{exc.code}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


_FAILURES = (S3Error, ServerError, InvalidResponseError, urllib3.exceptions.HTTPError, OSError)


@dataclass(frozen=True)
class _Object:
    """One object as read: its bytes, its etag (quoted, as If-Match wants it), headers."""

    data: bytes
    etag: str
    headers: Mapping[str, str]


def _make_http_client(timeout_s: float) -> urllib3.PoolManager:
    """A pool without urllib3's retries (tenacity retries instead, see the module doc),
    sized for the thread pools that read and write the store at once."""
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=min(timeout_s, 10.0), read=timeout_s),
        maxsize=32,
        cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=False,
    )


@dataclass(frozen=True)
class Retry:
    """How a :class:`MinioStore` retries a transient failure: ``attempts`` tries per
    request in all, waiting ``wait_s`` doubled each time (at most ``max_wait_s``) in
    between; ``outage_limit_s`` replaces the attempts by waiting out an outage that long
    (:mod:`farm.core.outage`); ``timeout_s`` bounds one request's connect and read."""

    attempts: int = 5
    wait_s: float = 0.1
    max_wait_s: float = 2.0
    timeout_s: float = 60.0
    outage_limit_s: float | None = None


class MinioStore(BlobObjects):
    """Artifacts in one MinIO bucket; safe to share between threads (the SDK client is)."""

    def __init__(self, endpoint: str, access_key: str | None, secret_key: str | None,
                 bucket: str, secure: bool = False, *, retry: Retry | None = None,
                 http_client: urllib3.PoolManager | None = None) -> None:
        """Connect and create ``bucket`` if it is missing.

        ``retry`` says how transient failures are retried (:class:`Retry`).
        ``http_client`` replaces the connection pool (tests count requests through it);
        give it no retries of its own.
        """
        retry = retry or Retry()
        super().__init__()
        if not hasattr(Minio, "_put_object"):  # pragma: no cover - guards an SDK upgrade
            raise StoreError("the installed minio SDK has no Minio._put_object, which the "
                             "conditional writes of first-writer-wins need; use minio 7.2")
        self.endpoint = endpoint
        self.bucket = bucket
        self.secure = secure
        self._attempts = max(1, retry.attempts)
        self._wait_s = retry.wait_s
        self._max_wait_s = retry.max_wait_s
        self._http = http_client or _make_http_client(retry.timeout_s)
        self._waiter = (Waiter(f"MinIO at {endpoint}", retry.outage_limit_s,
                               is_down=is_transient)
                        if retry.outage_limit_s is not None else None)
        try:
            self._client = Minio(endpoint, access_key=access_key or None,
                                 secret_key=secret_key or None, secure=secure,
                                 http_client=self._http)
        except ValueError as exc:
            raise StoreError(f"store {self.location}: {exc}") from None
        self._closed = threading.Event()
        self._ensure_bucket()

    @classmethod
    def from_settings(cls, settings: Settings) -> MinioStore:
        """The store ``FARM_MINIO_*`` describe. The endpoint is ``host:port`` (TLS from
        ``FARM_MINIO_SECURE``) or a URL whose scheme says it (``https://host:port``)."""
        raw = settings.minio_endpoint
        if not raw:
            raise SettingsError("setting FARM_MINIO_ENDPOINT: not set")
        endpoint, secure = raw, settings.minio_secure
        if "://" in raw:
            url = urlsplit(raw)
            if url.scheme not in ("http", "https") or not url.netloc \
                    or url.path not in ("", "/") or url.query:
                raise SettingsError(f"setting FARM_MINIO_ENDPOINT: not host:port or "
                                    f"http(s)://host:port: {raw!r}")
            endpoint, secure = url.netloc, url.scheme == "https"
        access, secret = settings.minio_access_key, settings.minio_secret_key
        if access is None or secret is None:
            raise SettingsError("settings FARM_MINIO_ACCESS_KEY and FARM_MINIO_SECRET_KEY "
                                "must be set with FARM_MINIO_ENDPOINT")
        return cls(endpoint, access.get_secret_value(), secret.get_secret_value(),
                   settings.minio_bucket, secure,
                   retry=Retry(timeout_s=min(60.0, settings.outage_limit),
                               outage_limit_s=settings.outage_limit))

    @property
    def location(self) -> str:
        return f"minio://{self.endpoint}/{self.bucket}"

    def __repr__(self) -> str:
        return f"MinioStore({self.location!r})"

    # -- requests --------------------------------------------------------------------------
    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning("store %s: transient failure (%s); attempt %d of %d",
                    self.location, _describe(exc) if exc else "?", state.attempt_number,
                    self._attempts)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one request with retries on transient failures; a failure that is not
        transient, or outlasts the retries, becomes a :class:`StoreError`."""
        if self._waiter is not None:
            try:
                return self._waiter.call(fn)
            except OutageError as exc:
                raise StoreError(f"store {self.location}: {what}: {exc}") from None
            except _FAILURES as exc:
                raise StoreError(f"store {self.location}: {what}: {_describe(exc)}") from exc
        retrying = Retrying(
            retry=retry_if_exception(is_transient),
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential(multiplier=self._wait_s, max=self._max_wait_s),
            before_sleep=self._log_retry,
            reraise=True,
        )
        try:
            return retrying(fn)
        except _FAILURES as exc:
            raise StoreError(f"store {self.location}: {what}: {_describe(exc)}") from exc

    def _ensure_bucket(self) -> None:
        def ensure() -> None:
            if self._client.bucket_exists(self.bucket):
                return
            try:
                self._client.make_bucket(self.bucket)
            except S3Error as exc:
                if exc.code not in _BUCKET_TAKEN:  # another process made it first: fine
                    raise
        self._call("open bucket", ensure)

    def _fetch(self, name: str) -> _Object | None:
        """The object's bytes, etag and headers; ``None`` when there is no such object."""
        def once() -> _Object | None:
            try:
                response = self._client.get_object(self.bucket, name)
            except S3Error as exc:
                if exc.code == "NoSuchKey":
                    return None
                raise
            try:
                data = response.read()
                headers = {k.lower(): v for k, v in response.headers.items()}
            finally:
                response.close()
                response.release_conn()
            return _Object(data=data, etag=headers.get("etag", ""), headers=headers)
        return self._call(f"read {name}", once)

    def _write_if(self, name: str, body: bytes, headers: dict[str, str],
                  condition: dict[str, str]) -> bool:
        """Conditional PUT; ``False`` when the condition failed (412), or an ``If-Match``
        found no object (404): either way someone else changed the key first."""
        all_headers: dict[str, str | list[str] | tuple[str]] = {
            "Content-Type": "application/octet-stream", **headers, **condition}

        def once() -> bool:
            try:
                self._client._put_object(self.bucket, name, body, all_headers)
            except S3Error as exc:
                if exc.code == "PreconditionFailed" or (
                        "If-Match" in condition and exc.code == "NoSuchKey"):
                    return False
                raise
            return True
        return self._call(f"write {name}", once)

    def _list(self, prefix: str, *, recursive: bool) -> list[str]:
        """Object names (or, not recursive, common prefixes too) under ``prefix``: one
        listing, paged by the server at 1000 names a request."""
        def once() -> list[str]:
            return [o.object_name or "" for o in self._client.list_objects(
                self.bucket, prefix=prefix, recursive=recursive)]
        return self._call(f"list {prefix or '/'}", once)

    # -- reads -----------------------------------------------------------------------------
    def _decode(self, key: Key, obj: _Object) -> Artifact | None:
        """The verified artifact an object holds for ``key``, ``None`` when corrupt."""
        artifact = decode_artifact(obj.data)
        if artifact is None or not artifact.verify() or artifact.meta.key != key:
            return None
        header_digest = obj.headers.get(_META_PREFIX + _M_DIGEST)
        if header_digest is not None and header_digest != artifact.meta.digest:
            return None
        return artifact

    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        obj = self._fetch(artifact_object(ns, key))
        if obj is None:
            return None
        return checked(self, ns, key, self._decode(key, obj))

    def existing(self, ns: Namespace, keys: Iterable[Key]) -> set[Key]:
        """One listing of the namespace's artifacts (narrowed to the longest prefix the
        wanted names share), never a request per key: a build asks about thousands."""
        names = {artifact_object(ns, k): k for k in keys}
        if not names:
            return set()
        # a character prefix, not a path: S3 lists by characters
        prefix = os.path.commonprefix(list(names))  # noqa: RUF071
        if not prefix.startswith(artifacts_prefix(ns)):  # pragma: no cover - by construction
            prefix = artifacts_prefix(ns)
        return {names[n] for n in self._list(prefix, recursive=True) if n in names}

    def find_source(self, ns: Namespace, source_hash: str) -> Key | None:
        obj = self._fetch(source_object(ns, source_hash))
        if obj is None:
            return None
        try:
            return Key.parse(obj.data.decode("utf-8").strip())
        except (UnicodeDecodeError, ValueError):
            log.warning("store %s: source index entry %s/%s is unreadable; ignored",
                        self.location, ns, source_hash)
            return None

    def keys(self, ns: Namespace) -> Iterator[Key]:
        found = (key_from_artifact_object(ns, n)
                 for n in self._list(artifacts_prefix(ns), recursive=True))
        return iter(sorted((k for k in found if k is not None),
                           key=lambda k: (k.id_hash, k.build_id)))

    def namespaces(self) -> list[Namespace]:
        """Walk the namespace levels of common prefixes, then keep the namespaces with at
        least one artifact (a namespace left with only index entries does not count)."""
        levels = [""]
        for _ in range(NAMESPACE_LEVELS):
            levels = [p for parent in levels for p in self._list(parent, recursive=False)
                      if p.endswith("/")]
        found: list[Namespace] = []
        for prefix in levels:
            ns = namespace_from_prefix(prefix)
            if ns is not None and self._any(artifacts_prefix(ns)):
                found.append(ns)
        return sorted(found, key=str)

    def _any(self, prefix: str) -> bool:
        def once() -> bool:
            for _ in self._client.list_objects(self.bucket, prefix=prefix, recursive=True):
                return True
            return False
        return self._call(f"list {prefix}", once)

    # -- writes ----------------------------------------------------------------------------
    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        key = artifact.meta.key
        source_hash = index_hash(artifact, source)
        name = artifact_object(ns, key)
        body = encode_artifact(artifact)
        headers = _user_metadata(artifact)
        condition = {"If-None-Match": "*"}
        self._index(ns, key, source_hash)  # first: see the module docstring
        for _ in range(_MAX_PUT_ROUNDS):
            if self._write_if(name, body, headers, condition):
                if "If-Match" in condition:
                    self.stats.bump("repaired")
                    log.info("store %s: repaired corrupt artifact %s/%s",
                             self.location, ns, key)
                return PutResult.STORED
            obj = self._fetch(name)
            if obj is None:  # deleted since the 412: write as if new
                condition = {"If-None-Match": "*"}
                continue
            decision = decide_put(self._decode(key, obj), artifact)
            if decision is PutResult.REFUSED:
                log_refused(self, ns, key)
                return decision
            if decision is PutResult.SAME:  # maybe our own write, its reply lost
                return decision
            condition = {"If-Match": obj.etag}  # corrupt: replace exactly what we read
        raise StoreError(f"store {self.location}: {ns}/{key} kept changing under "
                         f"{_MAX_PUT_ROUNDS} conditional writes; giving up")

    def _index(self, ns: Namespace, key: Key, source_hash: str | None) -> None:
        """Point the source index at this key (last writer wins, as in SQLite: any key
        that holds the source is a valid answer). ``source_hash`` is one the writer
        computed from the source (``index_hash``); ``None`` writes nothing."""
        if source_hash is None:
            return
        name = source_object(ns, source_hash)
        body = str(key).encode("ascii")

        def once() -> None:
            self._client.put_object(self.bucket, name, io.BytesIO(body), len(body),
                                    content_type="text/plain")
        self._call(f"write {name}", once)

    def _source_hash_of(self, name: str) -> str | None:
        """The source hash of a stored artifact: from its headers (a HEAD), else its frame."""
        def head() -> Object | None:
            try:
                return self._client.stat_object(self.bucket, name)
            except S3Error as exc:
                if exc.code in ("NoSuchKey", "NoSuchObject"):
                    return None
                raise
        stat = self._call(f"stat {name}", head)
        if stat is None:
            return None
        metadata = {k.lower(): v for k, v in (stat.metadata or {}).items()}
        value = metadata.get(_META_PREFIX + _M_SOURCE)
        if isinstance(value, str) and value:
            return value
        obj = self._fetch(name)
        artifact = decode_artifact(obj.data) if obj is not None else None
        return artifact.meta.source_hash if artifact is not None else None

    def delete(self, ns: Namespace, key: Key) -> None:
        name = artifact_object(ns, key)
        source_hash = self._source_hash_of(name)
        if source_hash is not None and self.find_source(ns, source_hash) == key:
            index = source_object(ns, source_hash)
            self._call(f"delete {index}",
                       lambda: self._client.remove_object(self.bucket, index))
        self._call(f"delete {name}", lambda: self._client.remove_object(self.bucket, name))

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._http.clear()
