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

A digest says the bytes are the exporter's, not that a device can load them: a
truncated binary with a right digest crashes PoCL in whichever process loads it. So an
import validates, before anything is written, every artifact whose namespace names a
device of this machine, by loading it in a child process (the caller's ``validators``;
:mod:`farm.compilation.validate`). One that does not load there refuses the whole
bundle (a :class:`BundleError` naming it). Those that load are stored as
``origin="validated"``; the artifacts of namespaces with no device here keep
``origin="imported"``, and every loader validates such an artifact in a child process
before it loads it (docs/SECURITY.md). Tuning results (``DATA_FAMILIES``) hold no
binary: nothing loads them; their reader checks every one (``farm.tuning.store``).

An import never signs: a signature vouches that a farm writer compiled and validated
the binary, so imported artifacts keep the signatures the bundle carries (a verifying
reader refuses those of another key, or of another namespace).
"""

from __future__ import annotations

import datetime as dt
import io
import os
import socket
import tarfile
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from farm.core.errors import InputError
from farm.core.keys import DATA_FAMILIES, Namespace, artifact_object, blob_object
from farm.core.model import Artifact, Key
from farm.store.base import ArtifactStore, PutResult
from farm.store.bundle_format import (
    BUNDLE_FORMAT,
    BUNDLE_VERSION,
    DEFAULT_MAX_BYTES,
    MANIFEST_MEMBER,
    MAX_ARTIFACT_BYTES,
    MAX_ARTIFACTS,
    MAX_MANIFEST_BYTES,
    BundleArtifact,
    BundleBlob,
    BundleManifest,
    BundleNamespace,
    parse_namespace,
    reason,
)
from farm.store.bundle_read import Bundle, read_bundle, refuse
from farm.store.signing import SigningStore
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

# ----------------------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------------------
Verdict = Literal["imported", "skipped", "refused"]


#: a namespace's validator: proves an artifact in an isolated process on a device of that
#: fingerprint, answering "" when it loads, else why not
Validate = Callable[[Artifact], str]
#: the validator of a namespace, ``None`` when this machine has no such device
Validators = Callable[[Namespace], "Validate | None"]


@dataclass
class ImportReport:
    """What an import did, per namespace and in total."""

    bundle: str
    imported: int = 0
    skipped: int = 0
    refused: int = 0
    per_namespace: dict[str, Counter[str]] = field(default_factory=dict)
    refused_keys: list[str] = field(default_factory=list)
    #: artifacts loaded in a child process on a device of their fingerprint, here
    validated: int = 0
    #: namespace -> artifacts stored unvalidated (no device of that fingerprint here)
    unvalidated: dict[str, int] = field(default_factory=dict)

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
            "validated": self.validated,
            "unvalidated": dict(sorted(self.unvalidated.items())),
        }


def import_bundle(path: Path, store: ArtifactStore, *,
                  max_bytes: int = DEFAULT_MAX_BYTES,
                  validators: Validators | None = None) -> ImportReport:
    """Verify the whole bundle, validate what a device here can load, then put each
    artifact into its own namespace.

    Nothing is written unless every check passed (see the module doc). Idempotent:
    the same bundle again is all *skipped*.
    """
    bundle = read_bundle(path, max_bytes=max_bytes)
    report = ImportReport(bundle=str(path))
    origins = _validate(Path(path), bundle, validators, report)
    if isinstance(store, SigningStore) and store.signer is not None:
        store = SigningStore(store.inner, None, store.verifier)  # an import never signs
    for data in bundle.blobs.values():  # first: an artifact's sources are never missing
        store.put_blob(data)
    for ns, artifact in bundle.artifacts:
        meta = artifact.meta.model_copy(update={"origin": origins[(ns, artifact.meta.key)]})
        result = store.put(ns, Artifact(meta=meta, binary=artifact.binary))
        verdict: Verdict = ("imported" if result is PutResult.STORED else
                            "skipped" if result is PutResult.SAME else "refused")
        report.add(ns, meta.key, verdict)
    return report


Origin = Literal["imported", "validated"]


def _validate(path: Path, bundle: Bundle, validators: Validators | None,
              report: ImportReport) -> dict[tuple[Namespace, Key], Origin]:
    """Each artifact's origin once validated (or not) by its namespace's validator; a
    :class:`BundleError` for the first that does not load, before anything is written."""
    origins: dict[tuple[Namespace, Key], Origin] = {}
    per_ns: dict[Namespace, Validate | None] = {}
    for ns, artifact in bundle.artifacts:
        if ns not in per_ns:
            per_ns[ns] = validators(ns) if validators is not None else None
        if artifact.meta.family in DATA_FAMILIES:  # data, no binary: its reader checks it
            origins[(ns, artifact.meta.key)] = "imported"
            continue
        check = per_ns[ns]
        if check is None:
            origins[(ns, artifact.meta.key)] = "imported"
            report.unvalidated[str(ns)] = report.unvalidated.get(str(ns), 0) + 1
            continue
        why = check(artifact)
        if why:
            raise refuse(path, f"artifact {artifact.meta.key} ({artifact.meta.family}) "
                                f"in {ns} fails validation on this device: {why}")
        origins[(ns, artifact.meta.key)] = "validated"
        report.validated += 1
    return origins


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
