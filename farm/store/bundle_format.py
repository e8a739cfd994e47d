"""The bundle format's manifest: the first member of a bundle, validated with pydantic
before any member is read (see :mod:`farm.store.bundle` for the format and its rules).

Kept apart from reading, importing and exporting so that each module holds one thing:
what a bundle may declare (here), and what is done with one (there).
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

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
from farm.core.errors import first_error, one_line
from farm.core.keys import BACKEND, STORE_FORMAT, Namespace, artifact_object, blob_object
from farm.core.model import ArtifactMeta, Key

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


def reason(exc: BaseException) -> str:
    """One line saying why: pydantic's first message (without its field), else the
    first line of the exception's text."""
    if isinstance(exc, ValidationError) and exc.errors():
        return first_error(exc)[1]
    return one_line(exc)
