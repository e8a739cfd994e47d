"""Bundles: a store's artifacts in one file, for machines with no path to the store.

Format ``kernel-farm-bundle`` version 1 is a plain (uncompressed) POSIX tar archive:

* the first member is :data:`MANIFEST_MEMBER`, a JSON :class:`BundleManifest`: format
  and version, the farm version that wrote it, the creation time and host, every
  namespace with its fingerprint, count and bytes, and every artifact's namespace, key,
  size, SHA-256 digest and full metadata;
* then one regular-file member per artifact, named by :func:`farm.core.keys.artifact_object`
  (``<namespace>/artifacts/<id hash>/<build id>``), holding the binary;
* then one member per blob (programs' sources, headers and specs, ``farm.programs``),
  named by :func:`farm.core.keys.blob_object` (``blobs/<sha256>``): the manifest's
  ``blobs`` list (absent in bundles without programs). The exporter names the blobs to
  carry (``export_bundle(blobs=...)``); import puts them before any artifact, each
  verified against its name.

A bundle is **untrusted input**. It is read as one sequential stream, member by member,
in memory; nothing is ever extracted to disk, so member names are only labels and can
never reach a path. Every rule below is checked for the whole bundle *before* anything
is written, so a refused bundle leaves the target store as it was, and every refusal is
one :class:`~farm.core.errors.BundleError` line (the CLI exits 2):

* not a tar archive (garbage), truncated data, a manifest missing or not first;
* another format or format version;
* a member name that is absolute or climbs (``..``), a member that is not a regular
  file (links, devices, and *sparse* files, whose few stored bytes expand to any
  size), a duplicate member, a member the manifest does not list, an artifact the
  manifest lists but the bundle lacks;
* a namespace that is not a valid :class:`~farm.core.keys.Namespace` of this farm's backend
  and store format;
* a declared size over :data:`MAX_ARTIFACT_BYTES`, a file or a sum of sizes over the
  total cap (``max_bytes``), a member or a manifest that declares more bytes than the
  file holds (an uncompressed archive cannot), a member whose size disagrees with the
  manifest;
* a digest that does not match the bytes, metadata that disagrees with its entry.

Why uncompressed: the file size then bounds every byte the reader holds, so a small
hostile file cannot make it allocate gigabytes (a compressed stream could declare
anything). Compress the file for transport if you like; decompress before importing.

Import writes each artifact into *its own* namespace (the fingerprint is in it, so a
binary only ever reaches a device of that fingerprint) with ``origin="imported"``,
through the store's first-writer-wins ``put``: an absent key is *imported*, the same
value again is *skipped* (so importing twice changes nothing), and a different value
already held (compiled locally, or imported earlier from elsewhere) is *refused*,
never replaced.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import socket
import stat
import tarfile
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from farm.core.defaults import BUNDLE_MAX_BYTES
from farm.core.errors import BundleError, InputError, first_error, one_line
from farm.core.hashing import sha256_hex
from farm.core.keys import BACKEND, STORE_FORMAT, Namespace, artifact_object, blob_object
from farm.core.model import Artifact, ArtifactMeta, Key
from farm.store.base import ArtifactStore, PutResult
from farm.version import __version__

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "DEFAULT_MAX_BYTES",
    "MANIFEST_MEMBER",
    "MAX_ARTIFACTS",
    "MAX_ARTIFACT_BYTES",
    "MAX_MANIFEST_BYTES",
    "Bundle",
    "BundleArtifact",
    "BundleBlob",
    "BundleManifest",
    "BundleNamespace",
    "ExportReport",
    "ImportReport",
    "export_bundle",
    "import_bundle",
    "parse_namespace",
    "read_bundle",
    "reason",
]

BUNDLE_FORMAT = "kernel-farm-bundle"
BUNDLE_VERSION = 1
#: the first member of every bundle
MANIFEST_MEMBER = "kernel-farm-bundle.json"
#: a compiled kernel is kilobytes to a few megabytes; anything near this is an attack
MAX_ARTIFACT_BYTES = 256 * 1024 * 1024
#: the manifest is metadata only (build logs included)
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
#: artifacts one bundle may list
MAX_ARTIFACTS = 1_000_000
#: default cap on a bundle file (and on the sum of its artifacts): it is held in memory
#: while it is verified, because nothing may be written before everything is verified
DEFAULT_MAX_BYTES = BUNDLE_MAX_BYTES

_DIGEST = r"^[0-9a-f]{64}$"


# ----------------------------------------------------------------------------------------
# The manifest (pydantic at the boundary)
# ----------------------------------------------------------------------------------------
def parse_namespace(text: str) -> Namespace:
    """A namespace this farm serves, from its text (``opencl/v1/<fingerprint>``).

    Stricter than :meth:`Namespace.parse`, which checks only the fingerprint: a bundle
    must not name another backend or store format (nothing here could serve it), nor
    smuggle ``..`` or other text into the backend/format parts.
    """
    try:
        ns = Namespace.parse(text)
    except ValueError as exc:
        raise ValueError(f"not a valid namespace {text!r}: {reason(exc)}") from None
    if ns.backend != BACKEND or ns.format != STORE_FORMAT:
        raise ValueError(f"namespace {text!r} is not of backend {BACKEND} and store format "
                         f"{STORE_FORMAT}, the only ones this farm serves")
    return ns


class _Model(BaseModel):
    """Strict and immutable: a bundle field we do not know is a bundle we do not read."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class BundleNamespace(_Model):
    """One namespace of a bundle: which device its binaries are for, and how many."""

    namespace: str
    fingerprint: str
    artifacts: int = Field(ge=0, le=MAX_ARTIFACTS)
    bytes: int = Field(ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> BundleNamespace:
        ns = parse_namespace(self.namespace)
        if ns.fingerprint != self.fingerprint:
            raise ValueError(f"namespace {self.namespace} names fingerprint "
                             f"{ns.fingerprint}, not {self.fingerprint}")
        return self


class BundleArtifact(_Model):
    """One artifact: where it goes, what its bytes must be, and its stored metadata."""

    namespace: str
    key: Key
    member: str
    size: int = Field(ge=0)
    digest: str = Field(pattern=_DIGEST)
    meta: ArtifactMeta

    @field_validator("size")
    @classmethod
    def _sane_size(cls, value: int) -> int:
        if value > MAX_ARTIFACT_BYTES:
            raise ValueError(f"declared size {value} bytes exceeds the limit of "
                             f"{MAX_ARTIFACT_BYTES} bytes per artifact")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> BundleArtifact:
        ns = parse_namespace(self.namespace)
        if self.meta.key != self.key:
            raise ValueError(f"metadata names key {self.meta.key}, entry names {self.key}")
        if self.meta.size != self.size or self.meta.digest != self.digest:
            raise ValueError(f"metadata of {self.key} disagrees with its entry's size or "
                             "digest")
        if self.member != artifact_object(ns, self.key):
            raise ValueError(f"member {self.member!r} is not the name of {self.key} in "
                             f"{self.namespace}")
        return self

    @property
    def ns(self) -> Namespace:
        return parse_namespace(self.namespace)


class BundleBlob(_Model):
    """One blob: its digest (its name) and size; the member is ``blobs/<digest>``."""

    digest: str = Field(pattern=_DIGEST)
    size: int = Field(ge=0, le=MAX_ARTIFACT_BYTES)

    @property
    def member(self) -> str:
        return blob_object(self.digest)


class BundleManifest(_Model):
    """What a bundle holds; the first member of the archive."""

    format: Literal["kernel-farm-bundle"]
    version: Literal[1]
    farm_version: str
    created_at: AwareDatetime
    created_by: str = ""
    namespaces: list[BundleNamespace]
    artifacts: list[BundleArtifact] = Field(max_length=MAX_ARTIFACTS)
    total_bytes: int = Field(ge=0)
    blobs: list[BundleBlob] = Field(default_factory=list, max_length=MAX_ARTIFACTS)

    @model_validator(mode="after")
    def _consistent(self) -> BundleManifest:
        members = Counter([a.member for a in self.artifacts] + [b.member for b in self.blobs])
        dupes = [m for m, n in members.items() if n > 1]
        if dupes:
            raise ValueError(f"artifact {dupes[0]!r} is listed twice")
        counts = Counter(a.namespace for a in self.artifacts)
        sizes: Counter[str] = Counter()
        for a in self.artifacts:
            sizes[a.namespace] += a.size
        listed = {n.namespace: n for n in self.namespaces}
        if len(listed) != len(self.namespaces):
            raise ValueError("a namespace is listed twice")
        for name, count in counts.items():
            entry = listed.get(name)
            if entry is None:
                raise ValueError(f"artifacts of namespace {name} but the namespace is not "
                                 "listed")
            if entry.artifacts != count or entry.bytes != sizes[name]:
                raise ValueError(f"namespace {name} declares {entry.artifacts} artifact(s) "
                                 f"of {entry.bytes} bytes, the bundle lists {count} of "
                                 f"{sizes[name]} bytes")
        for name, entry in listed.items():
            if entry.artifacts and name not in counts:
                raise ValueError(f"namespace {name} declares {entry.artifacts} artifact(s), "
                                 "the bundle lists none")
        if self.total_bytes != sum(a.size for a in self.artifacts):
            raise ValueError("total_bytes is not the sum of the artifacts' sizes")
        return self


# ----------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------
@dataclass
class Bundle:
    """A bundle read and verified in full: its manifest and each artifact's bytes."""

    path: Path
    manifest: BundleManifest
    artifacts: list[tuple[Namespace, Artifact]]
    file_bytes: int
    #: verified blobs (digest -> bytes)
    blobs: dict[str, bytes] = field(default_factory=dict)


def reason(exc: BaseException) -> str:
    """One line saying why: pydantic's first message (without its field), else the
    first line of the exception's text."""
    if isinstance(exc, ValidationError) and exc.errors():
        return first_error(exc)[1]
    return one_line(exc)


def _refuse(path: Path, message: str) -> BundleError:
    return BundleError(f"bundle {path}: {message}; nothing imported")


def _unsafe_name(name: str) -> str | None:
    """Why a member name is refused outright, or ``None``: names are only compared,
    never used as paths, but a name that would escape says the file is hostile."""
    if not name or "\0" in name or "\\" in name:
        return "an empty or malformed name"
    if name.startswith("/") or PurePosixPath(name).is_absolute():
        return "an absolute path"
    if ".." in PurePosixPath(name).parts:
        return "a path that climbs out of the bundle ('..')"
    return None


def _check_member(path: Path, member: tarfile.TarInfo, limit: int) -> None:
    why = _unsafe_name(member.name)
    if why is not None:
        raise _refuse(path, f"member {member.name!r} is {why}")
    if not member.isreg() or member.issparse() or member.type == tarfile.GNUTYPE_SPARSE:
        raise _refuse(path, f"member {member.name!r} is not a regular file "
                            "(links, folders, devices and sparse files are refused)")
    if member.size < 0 or member.size > limit:
        raise _refuse(path, f"member {member.name!r} declares {member.size} bytes, over the "
                            f"limit of {limit} bytes")


def _manifest_from(path: Path, raw: bytes) -> BundleManifest:
    """Validate the manifest, reporting the format version before any field error: a
    bundle of another version has other fields, and its version is what matters."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _refuse(path, f"manifest is not JSON ({one_line(exc)})") from None
    if not isinstance(data, dict):
        raise _refuse(path, "manifest is not a JSON object")
    if data.get("format") != BUNDLE_FORMAT:
        raise _refuse(path, f"not a {BUNDLE_FORMAT} (manifest format "
                            f"{data.get('format')!r})")
    if data.get("version") != BUNDLE_VERSION:
        raise _refuse(path, f"bundle format version {data.get('version')!r}; this farm "
                            f"({__version__}) reads version {BUNDLE_VERSION}")
    try:
        return BundleManifest.model_validate(data)
    except ValidationError as exc:
        where, msg = first_error(exc, "manifest")
        raise _refuse(path, f"manifest {where}: {msg}") from None


def read_bundle(path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Bundle:
    """Read and verify a whole bundle; raise :class:`BundleError` on the first problem.

    Sequential, in memory, never extracting: one pass over the tar stream, each member
    checked (name, type, size) before its bytes are read, each artifact's digest
    verified, and every listed artifact required to be present.
    """
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise BundleError(f"bundle {path}: no such file") from None
    except OSError as exc:
        raise BundleError(f"bundle {path}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(info.st_mode):
        raise BundleError(f"bundle {path}: not a regular file")
    if info.st_size > max_bytes:
        raise _refuse(path, f"{info.st_size} bytes, over the limit of {max_bytes} bytes")
    try:
        with path.open("rb") as fh:
            return _read_stream(path, fh, max_bytes, info.st_size)
    except BundleError:
        raise
    except (tarfile.TarError, EOFError) as exc:
        raise _refuse(path, f"truncated or corrupt archive ({one_line(exc)})") from None
    except OSError as exc:
        raise BundleError(f"bundle {path}: cannot read ({exc.strerror or exc})") from None


def _read_stream(path: Path, fh: io.BufferedReader, max_bytes: int,
                 file_bytes: int) -> Bundle:
    try:
        tar = tarfile.open(fileobj=fh, mode="r|")
    except tarfile.TarError:
        raise _refuse(path, "not a kernel-farm bundle (not a tar archive: garbage, or "
                            "truncated in its first header)") from None
    with tar:
        first = tar.next()
        if first is None:
            raise _refuse(path, "empty archive")
        if first.name != MANIFEST_MEMBER:
            why = _unsafe_name(first.name)
            if why is not None:
                raise _refuse(path, f"member {first.name!r} is {why}")
            raise _refuse(path, f"not a kernel-farm bundle (first member is "
                                f"{first.name!r}, not {MANIFEST_MEMBER})")
        limit = min(MAX_MANIFEST_BYTES, file_bytes)
        _check_member(path, first, limit)
        manifest = _manifest_from(path, _read_member(path, tar, first))
        if manifest.total_bytes > min(max_bytes, file_bytes):
            raise _refuse(path, f"declares {manifest.total_bytes} bytes of artifacts, over "
                                f"the limit of {min(max_bytes, file_bytes)} bytes (the "
                                "cap, or what the file holds)")
        wanted = {a.member: a for a in manifest.artifacts}
        blobs = {b.member: b for b in manifest.blobs}
        found: dict[str, Artifact] = {}
        got_blobs: dict[str, bytes] = {}
        total = 0
        while (member := tar.next()) is not None:
            _check_member(path, member, min(MAX_ARTIFACT_BYTES, file_bytes))
            entry = wanted.get(member.name)
            if entry is None and member.name in blobs:
                _read_blob(path, tar, member, blobs[member.name], got_blobs)
                continue
            if entry is None:
                if member.name in found or member.name == MANIFEST_MEMBER:
                    raise _refuse(path, f"member {member.name!r} appears twice")
                raise _refuse(path, f"member {member.name!r} is not listed in the manifest")
            if member.name in found:
                raise _refuse(path, f"member {member.name!r} appears twice")
            if member.size != entry.size:
                raise _refuse(path, f"member {member.name!r} holds {member.size} bytes, the "
                                    f"manifest declares {entry.size}")
            total += member.size
            if total > max_bytes:
                raise _refuse(path, f"artifacts exceed the limit of {max_bytes} bytes")
            data = _read_member(path, tar, member)
            if len(data) != entry.size:
                raise _refuse(path, f"member {member.name!r} is truncated")
            if sha256_hex(data) != entry.digest:
                raise _refuse(path, f"digest mismatch for {entry.key} in {entry.namespace}")
            found[member.name] = Artifact(meta=entry.meta, binary=data)
    missing = [m for m in wanted if m not in found] + \
        [b.member for b in manifest.blobs if b.digest not in got_blobs]
    if missing:
        raise _refuse(path, f"truncated: {len(missing)} artifact(s) or blob(s) listed in the "
                            f"manifest are missing (first: {missing[0]})")
    artifacts = [(a.ns, found[a.member]) for a in manifest.artifacts]
    return Bundle(path=path, manifest=manifest, artifacts=artifacts, file_bytes=file_bytes,
                  blobs=got_blobs)


def _read_blob(path: Path, tar: tarfile.TarFile, member: tarfile.TarInfo, entry: BundleBlob,
               got: dict[str, bytes]) -> None:
    if entry.digest in got:
        raise _refuse(path, f"member {member.name!r} appears twice")
    data = _read_member(path, tar, member)
    if len(data) != entry.size or sha256_hex(data) != entry.digest:
        raise _refuse(path, f"blob {entry.digest} does not hold the bytes its name says")
    got[entry.digest] = data


def _read_member(path: Path, tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    if handle is None:  # pragma: no cover - regular files always have a handle
        raise _refuse(path, f"member {member.name!r} has no data")
    data = handle.read(member.size)
    if len(data) != member.size:
        raise _refuse(path, f"truncated: member {member.name!r} ends after {len(data)} of "
                            f"{member.size} bytes")
    return data


# ----------------------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------------------
Verdict = Literal["imported", "skipped", "refused"]


@dataclass
class ImportReport:
    """What an import did, per namespace and in total."""

    bundle: str
    imported: int = 0
    skipped: int = 0
    refused: int = 0
    per_namespace: dict[str, Counter[str]] = field(default_factory=dict)
    refused_keys: list[str] = field(default_factory=list)

    def add(self, ns: Namespace, key: Key, verdict: Verdict) -> None:
        setattr(self, verdict, getattr(self, verdict) + 1)
        self.per_namespace.setdefault(str(ns), Counter())[verdict] += 1
        if verdict == "refused":
            self.refused_keys.append(f"{ns}/{key}")

    def summary(self) -> dict[str, object]:
        return {
            "bundle": self.bundle,
            "imported": self.imported,
            "skipped": self.skipped,
            "refused": self.refused,
            "namespaces": {ns: {v: c.get(v, 0) for v in ("imported", "skipped", "refused")}
                           for ns, c in sorted(self.per_namespace.items())},
            "refused_keys": self.refused_keys,
        }


def import_bundle(path: Path, store: ArtifactStore, *,
                  max_bytes: int = DEFAULT_MAX_BYTES) -> ImportReport:
    """Verify the whole bundle, then put each artifact into its own namespace.

    Nothing is written unless every check passed (see the module doc). Idempotent:
    the same bundle again is all *skipped*.
    """
    bundle = read_bundle(path, max_bytes=max_bytes)
    report = ImportReport(bundle=str(path))
    for data in bundle.blobs.values():  # first: an artifact's sources are never missing
        store.put_blob(data)
    for ns, artifact in bundle.artifacts:
        meta = artifact.meta.model_copy(update={"origin": "imported"})
        result = store.put(ns, Artifact(meta=meta, binary=artifact.binary))
        verdict: Verdict = ("imported" if result is PutResult.STORED else
                            "skipped" if result is PutResult.SAME else "refused")
        report.add(ns, meta.key, verdict)
    return report


# ----------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------
@dataclass
class ExportReport:
    """What an export wrote."""

    path: Path
    manifest: BundleManifest
    file_bytes: int
    unreadable: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        return {
            "bundle": str(self.path),
            "bytes": self.file_bytes,
            "artifacts": len(self.manifest.artifacts),
            "namespaces": [n.model_dump() for n in self.manifest.namespaces],
            "unreadable": self.unreadable,
        }


def export_bundle(store: ArtifactStore, namespaces: Iterable[Namespace] | None, out: Path,
                  *, overwrite: bool = False,
                  blobs_of: Callable[[Artifact], Iterable[str]] | None = None
                  ) -> ExportReport:
    """Write the artifacts of ``namespaces`` (``None``: every namespace) to ``out``, and
    the blobs ``blobs_of(artifact)`` names for each (a program's sources and spec:
    ``farm.programs.bundles``).

    Every artifact is read through the store's verified ``get``; one that fails its
    digest is left out and named in :attr:`ExportReport.unreadable` (a bundle never
    carries a binary its own store does not vouch for). Binaries are spooled to a
    temporary file while the manifest is built, so memory stays small, and the bundle
    is written beside ``out`` and renamed into place, so a failed export leaves no
    half-written file under that name.
    """
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_file()):
        # --force replaces a bundle file, never a device, a pipe, a folder or a link
        # (as root, renaming onto /dev/full would replace the device node)
        raise InputError(f"{out} exists and is not a regular file; refusing to replace it")
    if out.exists() and not overwrite:
        raise InputError(f"{out} exists; pass --force to replace it")
    chosen = sorted(set(namespaces), key=str) if namespaces is not None else \
        store.namespaces()
    entries: list[tuple[BundleArtifact, int]] = []
    unreadable: list[str] = []
    blobs: dict[str, None] = {}
    with tempfile.TemporaryFile() as spool:
        for ns in chosen:
            for key in store.keys(ns):
                artifact = store.get(ns, key)
                if artifact is None:
                    unreadable.append(f"{ns}/{key}")
                    continue
                if blobs_of is not None:
                    blobs.update(dict.fromkeys(blobs_of(artifact)))
                offset = spool.tell()
                spool.write(artifact.binary)
                entries.append((BundleArtifact(
                    namespace=str(ns), key=key, member=artifact_object(ns, key),
                    size=artifact.meta.size, digest=artifact.meta.digest,
                    meta=artifact.meta), offset))
        if not entries:
            what = ", ".join(str(n) for n in chosen) or "the store"
            raise InputError(f"nothing to export: {what} holds no readable artifact")
        carried: dict[str, bytes] = {}
        for digest in blobs:
            data = store.get_blob(digest)
            if data is None:
                unreadable.append(blob_object(digest))
            else:
                carried[digest] = data
        manifest = _manifest_for([e for e, _ in entries]).model_copy(update={
            "blobs": [BundleBlob(digest=d, size=len(b)) for d, b in carried.items()]})
        file_bytes = _write_tar(out, manifest, entries, spool, carried)
    return ExportReport(path=out, manifest=manifest, file_bytes=file_bytes,
                        unreadable=unreadable)


def _manifest_for(artifacts: list[BundleArtifact]) -> BundleManifest:
    per_ns: dict[str, list[BundleArtifact]] = {}
    for a in artifacts:
        per_ns.setdefault(a.namespace, []).append(a)
    namespaces = [BundleNamespace(namespace=name, fingerprint=parse_namespace(name).fingerprint,
                                  artifacts=len(items), bytes=sum(a.size for a in items))
                  for name, items in sorted(per_ns.items())]
    return BundleManifest(format=BUNDLE_FORMAT, version=BUNDLE_VERSION,
                          farm_version=__version__, created_at=dt.datetime.now(dt.UTC),
                          created_by=socket.gethostname(), namespaces=namespaces,
                          artifacts=artifacts, total_bytes=sum(a.size for a in artifacts))


def _tar_info(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = int(mtime)
    info.mode = 0o644
    info.type = tarfile.REGTYPE
    return info


def _write_tar(out: Path, manifest: BundleManifest,
               entries: list[tuple[BundleArtifact, int]], spool: IO[bytes],
               blobs: dict[str, bytes]) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    mtime = manifest.created_at.timestamp()
    raw = manifest.model_dump_json(indent=1).encode("utf-8")
    try:
        with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(_tar_info(MANIFEST_MEMBER, len(raw), mtime), io.BytesIO(raw))
            for entry, offset in entries:
                spool.seek(offset)
                data = spool.read(entry.size)
                tar.addfile(_tar_info(entry.member, entry.size, mtime), io.BytesIO(data))
            for digest, blob in blobs.items():
                tar.addfile(_tar_info(blob_object(digest), len(blob), mtime),
                            io.BytesIO(blob))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out.stat().st_size
