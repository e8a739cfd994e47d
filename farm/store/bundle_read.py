"""Reading a bundle: one sequential pass over the tar stream, in memory, never extracting,
every rule of :mod:`farm.store.bundle` checked before anything is returned.

Kept apart from importing and exporting (:mod:`farm.store.bundle`) and from what a
manifest may declare (:mod:`farm.store.bundle_format`): this module holds what a hostile
file can reach first.
"""

from __future__ import annotations

import io
import json
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from pydantic import ValidationError

from farm.core.errors import BundleError, first_error, one_line
from farm.core.hashing import sha256_hex
from farm.core.keys import Namespace
from farm.core.model import Artifact
from farm.store.bundle_format import (
    BUNDLE_FORMAT,
    BUNDLE_VERSION,
    DEFAULT_MAX_BYTES,
    MANIFEST_MEMBER,
    MAX_ARTIFACT_BYTES,
    MAX_MANIFEST_BYTES,
    BundleBlob,
    BundleManifest,
)
from farm.version import __version__


@dataclass
class Bundle:
    """A bundle read and verified in full: its manifest and each artifact's bytes."""

    path: Path
    manifest: BundleManifest
    artifacts: list[tuple[Namespace, Artifact]]
    file_bytes: int
    #: verified blobs (digest -> bytes)
    blobs: dict[str, bytes] = field(default_factory=dict)


def refuse(path: Path, message: str) -> BundleError:
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


def check_member(path: Path, member: tarfile.TarInfo, limit: int) -> None:
    why = _unsafe_name(member.name)
    if why is not None:
        raise refuse(path, f"member {member.name!r} is {why}")
    if not member.isreg() or member.issparse() or member.type == tarfile.GNUTYPE_SPARSE:
        raise refuse(path, f"member {member.name!r} is not a regular file "
                            "(links, folders, devices and sparse files are refused)")
    if member.size < 0 or member.size > limit:
        raise refuse(path, f"member {member.name!r} declares {member.size} bytes, over the "
                            f"limit of {limit} bytes")


def _manifest_from(path: Path, raw: bytes) -> BundleManifest:
    """Validate the manifest, reporting the format version before any field error: a
    bundle of another version has other fields, and its version is what matters."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise refuse(path, f"manifest is not JSON ({one_line(exc)})") from None
    if not isinstance(data, dict):
        raise refuse(path, "manifest is not a JSON object")
    if data.get("format") != BUNDLE_FORMAT:
        raise refuse(path, f"not a {BUNDLE_FORMAT} (manifest format "
                            f"{data.get('format')!r})")
    if data.get("version") != BUNDLE_VERSION:
        raise refuse(path, f"bundle format version {data.get('version')!r}; this farm "
                            f"({__version__}) reads version {BUNDLE_VERSION}")
    try:
        return BundleManifest.model_validate(data)
    except ValidationError as exc:
        where, msg = first_error(exc, "manifest")
        raise refuse(path, f"manifest {where}: {msg}") from None


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
        raise refuse(path, f"{info.st_size} bytes, over the limit of {max_bytes} bytes")
    try:
        with path.open("rb") as fh:
            return _read_stream(path, fh, max_bytes, info.st_size)
    except BundleError:
        raise
    except (tarfile.TarError, EOFError) as exc:
        raise refuse(path, f"truncated or corrupt archive ({one_line(exc)})") from None
    except OSError as exc:
        raise BundleError(f"bundle {path}: cannot read ({exc.strerror or exc})") from None


def _read_stream(path: Path, fh: io.BufferedReader, max_bytes: int,
                 file_bytes: int) -> Bundle:
    try:
        tar = tarfile.open(fileobj=fh, mode="r|")
    except tarfile.TarError:
        raise refuse(path, "not a kernel-farm bundle (not a tar archive: garbage, or "
                            "truncated in its first header)") from None
    with tar:
        first = tar.next()
        if first is None:
            raise refuse(path, "empty archive")
        if first.name != MANIFEST_MEMBER:
            why = _unsafe_name(first.name)
            if why is not None:
                raise refuse(path, f"member {first.name!r} is {why}")
            raise refuse(path, f"not a kernel-farm bundle (first member is "
                                f"{first.name!r}, not {MANIFEST_MEMBER})")
        limit = min(MAX_MANIFEST_BYTES, file_bytes)
        check_member(path, first, limit)
        manifest = _manifest_from(path, _read_member(path, tar, first))
        if manifest.total_bytes > min(max_bytes, file_bytes):
            raise refuse(path, f"declares {manifest.total_bytes} bytes of artifacts, over "
                                f"the limit of {min(max_bytes, file_bytes)} bytes (the "
                                "cap, or what the file holds)")
        wanted = {a.member: a for a in manifest.artifacts}
        blobs = {b.member: b for b in manifest.blobs}
        found: dict[str, Artifact] = {}
        got_blobs: dict[str, bytes] = {}
        total = 0
        while (member := tar.next()) is not None:
            check_member(path, member, min(MAX_ARTIFACT_BYTES, file_bytes))
            entry = wanted.get(member.name)
            if entry is None and member.name in blobs:
                _read_blob(path, tar, member, blobs[member.name], got_blobs)
                continue
            if entry is None:
                if member.name in found or member.name == MANIFEST_MEMBER:
                    raise refuse(path, f"member {member.name!r} appears twice")
                raise refuse(path, f"member {member.name!r} is not listed in the manifest")
            if member.name in found:
                raise refuse(path, f"member {member.name!r} appears twice")
            if member.size != entry.size:
                raise refuse(path, f"member {member.name!r} holds {member.size} bytes, the "
                                    f"manifest declares {entry.size}")
            total += member.size
            if total > max_bytes:
                raise refuse(path, f"artifacts exceed the limit of {max_bytes} bytes")
            data = _read_member(path, tar, member)
            if len(data) != entry.size:
                raise refuse(path, f"member {member.name!r} is truncated")
            if sha256_hex(data) != entry.digest:
                raise refuse(path, f"digest mismatch for {entry.key} in {entry.namespace}")
            found[member.name] = Artifact(meta=entry.meta, binary=data)
    missing = [m for m in wanted if m not in found] + \
        [b.member for b in manifest.blobs if b.digest not in got_blobs]
    if missing:
        raise refuse(path, f"truncated: {len(missing)} artifact(s) or blob(s) listed in the "
                            f"manifest are missing (first: {missing[0]})")
    artifacts = [(a.ns, found[a.member]) for a in manifest.artifacts]
    return Bundle(path=path, manifest=manifest, artifacts=artifacts, file_bytes=file_bytes,
                  blobs=got_blobs)


def _read_blob(path: Path, tar: tarfile.TarFile, member: tarfile.TarInfo, entry: BundleBlob,
               got: dict[str, bytes]) -> None:
    if entry.digest in got:
        raise refuse(path, f"member {member.name!r} appears twice")
    data = _read_member(path, tar, member)
    if len(data) != entry.size or sha256_hex(data) != entry.digest:
        raise refuse(path, f"blob {entry.digest} does not hold the bytes its name says")
    got[entry.digest] = data


def _read_member(path: Path, tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    if handle is None:  # pragma: no cover - regular files always have a handle
        raise refuse(path, f"member {member.name!r} has no data")
    data = handle.read(member.size)
    if len(data) != member.size:
        raise refuse(path, f"truncated: member {member.name!r} ends after {len(data)} of "
                            f"{member.size} bytes")
    return data


