"""The cluster artifact store: one MinIO (S3) bucket, objects laid out by :mod:`farm.core.keys`.

Objects are frames (:mod:`farm.store.frames`): magic, length-prefixed metadata JSON, the
binary. Why a frame inside the object: S3 user metadata is limited to about 2 KiB, and a build
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
conditional writes are sent with their headers as given: by
:class:`~farm.store.s3_put.S3Writer` (a signed PUT on a kept socket, a third of the
SDK's CPU; the region signed for is ``FARM_MINIO_REGION``, so no process asks the server
for it), or, in a store given a connection pool of its own (tests count and fail
requests through it) or no credentials, by ``Minio._put_object``, the SDK's own
single-part upload (checked when the store is made). Both answer alike: the writer
raises the SDK's error of an answer.

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

A worker's look under its compile lease is one request (:meth:`MinioStore.claim_source`):
the source-index entry written with ``If-None-Match: *``. Written, the source was
unindexed, and so (index first, always) the key unstored: the kernel is compiled without
reading anything, and its ``put`` writes the artifact alone (the store remembers the
entries it claimed until their put). Refused (412), the entry is read and the kernel
looked up as before. So a compiled kernel costs two requests, both writes: its index
entry, then its artifact (it cost four: two reads that missed, two writes).
"""

from __future__ import annotations

import datetime as dt
import io
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import urllib3
from minio import Minio
from minio.datatypes import Object
from minio.error import S3Error

from farm.core.errors import SettingsError, StoreError
from farm.core.keys import (
    NAMESPACE_LEVELS,
    Namespace,
    artifact_object,
    artifacts_prefix,
    key_from_artifact_object,
    namespace_from_prefix,
    quarantine_object,
    quarantine_prefix,
    source_object,
)
from farm.core.model import Artifact, Key, Lowered
from farm.core.outage import OutageError, Waiter
from farm.store.base import (
    PutResult,
    Quarantined,
    checked,
    decide_put,
    index_hash,
    log_refused,
    quarantine_reason,
)
from farm.store.frames import (
    M_DIGEST,
    M_SOURCE,
    MAGIC,  # noqa: F401 - re-exported: readers and tests take frames apart by it
    META_PREFIX,
    decode_artifact,
    decode_quarantined,
    encode_artifact,
    encode_quarantined,
    header_text,
    user_metadata,
)
from farm.store.minio_blobs import BlobObjects
from farm.store.minio_index import SourceIndex
from farm.store.minio_removal import Removal, is_tombstone
from farm.store.s3_failures import (
    FAILURES,
    ClientOptions,
    Retry,
    describe,
    is_transient,
    make_http_client,
    store_error,
)
from farm.store.s3_put import S3Writer

if TYPE_CHECKING:
    from tenacity import RetryCallState

    from farm.store.url import Opening, StoreURL

log = logging.getLogger(__name__)

T = TypeVar("T")

_BUCKET_TAKEN = frozenset({"BucketAlreadyOwnedByYou", "BucketAlreadyExists"})
#: rounds of (conditional write, read what is there) before a put gives up
_MAX_PUT_ROUNDS = 8



@dataclass(frozen=True)
class _Object:
    """One object as read: its bytes, its etag (quoted, as If-Match wants it), headers."""

    data: bytes
    etag: str
    headers: Mapping[str, str]


class MinioStore(Removal, SourceIndex, BlobObjects):
    """Artifacts in one MinIO bucket; safe to share between threads (the SDK client is)."""

    def __init__(self, endpoint: str, access_key: str | None, secret_key: str | None,
                 bucket: str, secure: bool = False, *, retry: Retry | None = None,
                 http_client: urllib3.PoolManager | None = None,
                 client: ClientOptions = ClientOptions()) -> None:
        """Connect and create ``bucket`` if it is missing.

        ``retry`` says how transient failures are retried (:class:`Retry`).
        ``http_client`` replaces the connection pool (tests count requests through it);
        give it no retries of its own: every request then goes through it, the writes
        too (else through :class:`~farm.store.s3_put.S3Writer`: the module docstring).
        ``client``: the region, and whether to check the bucket now (:class:`ClientOptions`).
        """
        retry = retry or Retry()
        super().__init__()
        # pragma: no cover - guards an SDK upgrade
        if not hasattr(Minio, "_put_object") or not hasattr(Minio, "_execute"):
            raise StoreError("the installed minio SDK has no Minio._put_object or "
                             "Minio._execute, which the conditional writes of "
                             "first-writer-wins and the bucket's check need; use minio 7.2")
        self.endpoint = endpoint
        self.bucket = bucket
        self.secure = secure
        self._attempts = max(1, retry.attempts)
        self._wait_s = retry.wait_s
        self._max_wait_s = retry.max_wait_s
        self._http = http_client or make_http_client(retry.timeout_s)
        self._waiter = (Waiter(f"MinIO at {endpoint}", retry.outage_limit_s,
                               is_down=is_transient)
                        if retry.outage_limit_s is not None else None)
        try:
            self._client = Minio(endpoint, access_key=access_key or None,
                                 secret_key=secret_key or None, secure=secure,
                                 region=client.region or None, http_client=self._http)
        except ValueError as exc:
            raise StoreError(f"store {self.location}: {exc}") from None
        #: the writes without the SDK, unless a pool was given or a signature is not
        self._writer = S3Writer(endpoint, secure, access_key, secret_key, bucket,
                                region=client.region, timeout_s=retry.timeout_s) \
            if http_client is None and access_key and secret_key and client.region \
            else None
        self._closed = threading.Event()
        self._init_index()
        self._init_removal(None if client.repair is None else Minio(
            endpoint, access_key=client.repair[0], secret_key=client.repair[1],
            secure=secure, region=client.region or None, http_client=self._http))
        if client.check_bucket:
            self._ensure_bucket()

    @classmethod
    def from_url(cls, url: StoreURL, opening: Opening) -> MinioStore:
        """``minio://host:port/bucket`` (``s3://`` alike; ``?secure=true``: TLS), with the
        credentials of ``FARM_MINIO_ACCESS_KEY`` and ``FARM_MINIO_SECRET_KEY``.

        Requests time out after ``FARM_SOCKET_TIMEOUT`` (a frozen MinIO is noticed in
        seconds) and an outage is waited out up to ``FARM_OUTAGE_LIMIT``; a probing
        opening tries each request once instead (a readiness check must answer now, not
        after the outage). ``opening.create`` makes the bucket when it is missing."""
        endpoint, bucket, secure = url.bucket()
        settings = opening.settings
        access, secret = settings.minio_access_key, settings.minio_secret_key
        if access is None or secret is None:
            raise SettingsError("settings FARM_MINIO_ACCESS_KEY and FARM_MINIO_SECRET_KEY "
                                "must be set with FARM_MINIO_ENDPOINT")
        retry = Retry(attempts=1, timeout_s=settings.socket_timeout) if opening.probe \
            else Retry(timeout_s=settings.socket_timeout,
                       outage_limit_s=settings.outage_limit)
        repair_access, repair_secret = (settings.minio_repair_access_key,
                                        settings.minio_repair_secret_key)
        repair = (repair_access.get_secret_value(), repair_secret.get_secret_value()) \
            if repair_access is not None and repair_secret is not None else None
        return cls(endpoint, access.get_secret_value(), secret.get_secret_value(),
                   bucket, secure, retry=retry,
                   client=ClientOptions(region=settings.minio_region,
                                        check_bucket=opening.create, repair=repair))

    @property
    def location(self) -> str:
        return f"minio://{self.endpoint}/{self.bucket}"

    def __repr__(self) -> str:
        return f"MinioStore({self.location!r})"

    # -- requests --------------------------------------------------------------------------
    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning("store %s: transient failure (%s); attempt %d of %d",
                    self.location, describe(exc) if exc else "?", state.attempt_number,
                    self._attempts)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one request with retries on transient failures; a failure that is not
        transient, or outlasts the retries, becomes a :class:`StoreError`
        (:class:`StoreAccessDenied` when the credentials may not do it)."""
        if self._waiter is not None:
            try:
                return self._waiter.call(fn)
            except OutageError as exc:
                raise StoreError(f"store {self.location}: {what}: {exc}") from None
            except FAILURES as exc:
                raise self._error(what, exc) from exc
        # a store made without settings (tests, tools): tenacity loads with it only
        from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

        retrying = Retrying(
            retry=retry_if_exception(is_transient),
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential(multiplier=self._wait_s, max=self._max_wait_s),
            before_sleep=self._log_retry,
            reraise=True,
        )
        try:
            return retrying(fn)
        except FAILURES as exc:
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: BaseException) -> StoreError:
        return store_error(f"store {self.location}: {what}", exc)

    def _ensure_bucket(self) -> None:
        """One request for a bucket that is there: its location asked (``GET
        ?location``: its answer, unlike a ``HEAD``'s, says why it is refused, a wrong
        secret as ``SignatureDoesNotMatch``; and it is the permission every client of
        the bucket had to have when the SDK asked it for the region); made when missing."""
        def ensure() -> None:
            try:
                self._client._execute("GET", self.bucket, query_params={"location": ""})
                return
            except S3Error as exc:
                if exc.code != "NoSuchBucket":
                    raise
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
        all_headers = {"Content-Type": "application/octet-stream", **headers, **condition}
        writer = self._writer

        def once() -> bool:
            try:
                if writer is not None:
                    writer.put(name, body, all_headers)
                else:
                    self._client._put_object(self.bucket, name, body, dict(all_headers))
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
        def once() -> list[str]:  # a tombstone (empty) is a deleted name: not listed
            return [o.object_name or "" for o in self._client.list_objects(
                self.bucket, prefix=prefix, recursive=recursive) if o.is_dir or o.size]
        return self._call(f"list {prefix or '/'}", once)

    # -- reads -----------------------------------------------------------------------------
    def _decode(self, key: Key, obj: _Object) -> Artifact | None:
        """The verified artifact an object holds for ``key``, ``None`` when corrupt."""
        artifact = decode_artifact(obj.data)
        if artifact is None or not artifact.verify() or artifact.meta.key != key:
            return None
        header_digest = obj.headers.get(META_PREFIX + M_DIGEST)
        if header_digest is not None and header_digest != artifact.meta.digest:
            return None
        return artifact

    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        obj = self._fetch(artifact_object(ns, key))
        if obj is None or is_tombstone(obj.data):
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
            return any(o.size for o in self._client.list_objects(
                self.bucket, prefix=prefix, recursive=True))
        return self._call(f"list {prefix}", once)

    # -- writes ----------------------------------------------------------------------------
    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        key = artifact.meta.key
        source_hash = index_hash(artifact, source)
        name = artifact_object(ns, key)
        body = encode_artifact(artifact)
        headers = user_metadata(artifact)
        condition = {"If-None-Match": "*"}
        over_tombstone = False
        self._index(ns, key, source_hash)  # first: see the module docstring
        for _ in range(_MAX_PUT_ROUNDS):
            if self._write_if(name, body, headers, condition):
                if "If-Match" in condition and not over_tombstone:
                    self.stats.bump("repaired")
                    log.info("store %s: repaired corrupt artifact %s/%s",
                             self.location, ns, key)
                return PutResult.STORED
            obj = self._fetch(name)
            if obj is None:  # deleted since the 412: write as if new
                condition = {"If-None-Match": "*"}
                continue
            over_tombstone = is_tombstone(obj.data)
            if over_tombstone:  # deleted by a store that may not delete: write over it
                condition = {"If-Match": obj.etag}
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
        value = metadata.get(META_PREFIX + M_SOURCE)
        if isinstance(value, str) and value:
            return value
        obj = self._fetch(name)
        artifact = decode_artifact(obj.data) if obj is not None else None
        return artifact.meta.source_hash if artifact is not None else None

    def delete(self, ns: Namespace, key: Key) -> None:
        name = artifact_object(ns, key)
        source_hash = self._source_hash_of(name)
        if source_hash is not None and self.find_source(ns, source_hash) == key:
            self._remove(source_object(ns, source_hash))
        self._remove(name)

    def quarantine(self, ns: Namespace, key: Key, digest: str, reason: str) -> bool:
        """Copy the object aside (``<ns>/quarantine/...``, with why and when), then
        delete it if it is still the object read (same etag): S3 has no conditional
        delete, so a repair written in between is at worst deleted too, which costs a
        compile, never a wrong binary."""
        name = artifact_object(ns, key)
        obj = self._fetch(name)
        artifact = decode_artifact(obj.data) if obj is not None else None
        if obj is None or artifact is None or artifact.meta.digest != digest:
            return False
        body = encode_quarantined(artifact, quarantine_reason(reason), dt.datetime.now(dt.UTC))
        evidence = quarantine_object(ns, key, digest)

        def keep() -> None:
            self._client.put_object(self.bucket, evidence, io.BytesIO(body), len(body),
                                    content_type="application/octet-stream",
                                    metadata={"farm-reason": header_text(reason)})
        self._call(f"write {evidence}", keep)
        now = self._fetch(name)
        if now is None or now.etag != obj.etag:
            return False
        self.delete(ns, key)
        log.warning("store %s: %s/%s quarantined: %s", self.location, ns, key, reason)
        return True

    def quarantined(self, ns: Namespace) -> list[Quarantined]:
        found = []
        for name in self._list(quarantine_prefix(ns), recursive=True):
            obj = self._fetch(name)
            entry = decode_quarantined(obj.data) if obj is not None else None
            if entry is None:
                log.warning("store %s: quarantine object %s does not read; skipped",
                            self.location, name)
                continue
            found.append(entry)
        return sorted(found, key=lambda q: q.at)

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._http.clear()
            if self._writer is not None:
                self._writer.close()
