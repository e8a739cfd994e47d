"""The data model of the compile path: ids, keys, artifacts, failures.

Every value that crosses a boundary (a task payload, a stored artifact's metadata, a
record) is one of these pydantic models, so it is validated where it enters. Ids are
frozen: they are hashed, used as dict keys and compared across processes.
"""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from farm.core.hashing import SHA256_HEX, canonical_json, sha256_hex, stable_hash
from farm.core.outcomes import Fate

#: the largest integer every storage takes (SQLite and PostgreSQL BIGINT): an integer
#: from outside beyond it is refused where it enters, not by a database later
INT64_MAX = 2**63 - 1

NonNegInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""A count, a size, a sequence number."""

def _no_nul(value: str) -> str:
    """PostgreSQL text cannot hold NUL: refused where it enters, not by the database (a
    records entry with one would otherwise fail its batch on every retry)."""
    if "\x00" in value:
        raise ValueError("text must not contain NUL characters")
    return value


Name = Annotated[str, StringConstraints(min_length=1, max_length=200), AfterValidator(_no_nul)]
"""A family name, a host, a worker: short text for tables and logs."""

ShortText = Annotated[str, StringConstraints(max_length=1000), AfterValidator(_no_nul)]
"""Free text that is not a log: labels, hosts."""

ColumnText = Annotated[str, StringConstraints(max_length=64), AfterValidator(_no_nul)]
"""Text stored in a 64-character column (records storage: versions, OS, architecture)."""

Int32 = Annotated[int, Field(ge=0, le=2**31 - 1)]
"""A non-negative integer stored in a 32-bit column (a process id)."""

LogText = Annotated[str, StringConstraints(max_length=4 * 1024 * 1024)]
"""A build log: long, but bounded."""


#: a kernel's parameters are a handful of numbers and names
MAX_PARAMS_JSON = 64 * 1024


class Frozen(BaseModel):
    """Immutable, strict-about-extra-fields base for ids and payloads. Floats are finite
    (JSON has no Infinity or NaN, so a value stored as one could never be read back)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class LaunchSettings(Frozen):
    """What a launch fixes that the kernel's code may be specialized for.

    ``local_size`` is the work-group shape the kernel is compiled for (``None``: the
    family picks its own default). It is part of the kernel id because a kernel compiled
    with ``reqd_work_group_size`` cannot be launched with another shape.
    """

    local_size: tuple[int, ...] | None = None

    @field_validator("local_size")
    @classmethod
    def _positive(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and (not 1 <= len(value) <= 3
                                  or any(not 1 <= v <= 65536 for v in value)):
            raise ValueError("local_size must be 1 to 3 integers from 1 to 65536")
        return value


class KernelId(Frozen):
    """Family name + validated compile-time parameters + launch settings.

    ``params`` holds the family's parameter model dumped to JSON-compatible values
    (defaults filled in), so two spellings of the same kernel have the same id.
    """

    family: Name
    params: dict[str, Any] = Field(default_factory=dict)
    launch: LaunchSettings = LaunchSettings()

    @field_validator("params")
    @classmethod
    def _json_data(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Parameters are hashed as canonical JSON: refuse what has none (Infinity, NaN,
        objects) here, at the boundary, rather than when the key is computed."""
        try:
            text = canonical_json(value)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"parameters are not finite JSON data ({exc})") from None
        if len(text) > MAX_PARAMS_JSON:
            raise ValueError(f"parameters take {len(text)} bytes as JSON, over the limit "
                             f"of {MAX_PARAMS_JSON}")
        return value

    def __hash__(self) -> int:  # dict params are unhashable; hash the canonical form
        return hash(self.id_hash)

    @property
    def id_hash(self) -> str:
        """Stable hash of the kernel id alone."""
        return stable_hash(self.model_dump(mode="json"))

    def label(self) -> str:
        """Short readable name for tables and logs."""
        inner = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.family}({inner})"


class Variant(Frozen):
    """What a launch decides that the kernel id does not: build options, alignment."""

    options: tuple[Annotated[str, StringConstraints(max_length=1000)], ...] = Field(
        default=(), max_length=256)
    alignment: int = Field(default=0, ge=0, le=2**20)

    @field_validator("options")
    @classmethod
    def _safe_options(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for opt in value:
            if not opt.startswith("-") or any(c in opt for c in "\n\r\0"):
                raise ValueError(f"build option {opt!r} must be a single '-' flag")
        return value


class ArtifactId(Frozen):
    """Kernel id + variant: what one compiled binary is for."""

    kernel: KernelId
    variant: Variant = Variant()

    def __hash__(self) -> int:
        return hash(self.id_hash)

    @property
    def id_hash(self) -> str:
        """The ``id`` part of the key: a stable hash of kernel id and variant."""
        return stable_hash(self.model_dump(mode="json"))

    def describe(self) -> str:
        """The kernel's label with everything else that is part of its key: the launch's
        ``local_size`` and the variant's options and alignment, where set (two kernels
        that differ only there have one label)."""
        parts = [self.kernel.label()]
        if self.kernel.launch.local_size is not None:
            parts.append(f"local_size={list(self.kernel.launch.local_size)}")
        if self.variant.options:
            parts.append(f"options={' '.join(self.variant.options)!r}")
        if self.variant.alignment:
            parts.append(f"alignment={self.variant.alignment}")
        return " ".join(parts)


class Key(Frozen):
    """(id hash, build id): how an artifact is found without expanding the kernel."""

    id_hash: str = Field(pattern=r"^[0-9a-f]{8,64}$")
    build_id: str = Field(pattern=r"^[0-9a-f]{8,64}$")

    def __str__(self) -> str:
        return f"{self.id_hash}.{self.build_id}"

    @classmethod
    def parse(cls, text: str) -> Key:
        """Inverse of ``str(key)``."""
        id_hash, _, build_id = text.partition(".")
        return cls(id_hash=id_hash, build_id=build_id)


#: a kernel name as OpenCL C spells one (an identifier)
KernelName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,199}$")]
#: an NDRange dimension: 1 to 3 sizes
Sizes = Annotated[tuple[Annotated[int, Field(ge=1, le=2**32)], ...],
                  Field(min_length=1, max_length=3)]


class LaunchArg(Frozen):
    """One argument of a :class:`ReadyLaunch`: a buffer of ``nbytes`` (zero-filled), local
    memory of ``nbytes``, or a scalar ``value`` of numpy type ``dtype`` (e.g. ``<u4``)."""

    kind: Literal["buffer", "local", "scalar"]
    nbytes: int = Field(default=0, ge=0, le=2**40)
    dtype: str = Field(default="", pattern=r"^([<>|=]?[biuf][1248])?$")
    value: int | float = 0


class ReadyLaunch(Frozen):
    """The launch a compiled artifact is made ready for: a kernel, its global and local
    size (``None``: left to the driver), and its arguments' sizes and scalars, never data.

    Where a driver makes a kernel's machine code at its first launch, specialised to the
    launch (PoCL's CPU drivers: by local size, zero offset and grid width), the process
    that compiles launches this once before taking the binary, so the binary carries that
    code and a load's first launch compiles nothing (:mod:`farm.compilation.ready`). It
    travels with :class:`Lowered` but is no part of its source hash: it decides what
    else an artifact carries, not what the compiler sees.
    """

    kernel_name: KernelName
    global_size: Sizes
    local_size: Sizes | None = None
    args: tuple[LaunchArg, ...] = Field(default=(), max_length=256)

    @field_validator("local_size")
    @classmethod
    def _same_rank(cls, value: tuple[int, ...] | None,
                   info: ValidationInfo) -> tuple[int, ...] | None:
        glob = info.data.get("global_size")
        if value is not None and glob is not None and len(value) != len(glob):
            raise ValueError("local_size must have as many dimensions as global_size")
        return value


class Lowered(Frozen):
    """A kernel expanded to OpenCL C for one device: the reusable *source*.

    ``kernel_names`` are the kernels the family declares: a binary served for this
    kernel must hold exactly these (:mod:`farm.compilation.load`). A family declares at
    least one (:mod:`farm.families.boundary`); an opaque program's record has none (its
    names come from the built program)."""

    source: str
    options: tuple[str, ...] = ()
    kernel_names: tuple[KernelName, ...] = Field(max_length=256)
    #: the launch its artifact is made ready for, where the device needs one (not hashed)
    ready: ReadyLaunch | None = None

    @property
    def source_hash(self) -> str:
        """Hash of what the compiler sees; equal hashes can share one binary."""
        return stable_hash({"source": self.source, "options": list(self.options)}, 64)


class RecordLevel(StrEnum):
    """How much a session records.

    Basic is the default because the code of a kernel (its expanded source and build
    options) is large and may be proprietary; everything else is small and is what a
    person needs to see what a build cost and why.
    """

    OFF = "off"
    BASIC = "basic"
    FULL = "full"


#: ``untrusted``: the workers answered for it, but the artifact they left is one this
#: client's FARM_VERIFY_KEY refuses (``farm.cluster.client``)
FailureKind = Literal[Fate.UNSUPPORTED, "validation", "compile", "load", "version-skew", "crashed",
                      "store", "infrastructure", "untrusted", "error"]

#: failures that are the farm's, not the kernel's (``farm.core.errors.InfrastructureError``):
#: a cluster never ends a kernel with one while a worker can still build it elsewhere
INFRASTRUCTURE_KINDS = frozenset({"store", "infrastructure"})


class KernelFailure(Frozen):
    """Why one kernel of a batch was not obtained."""

    kind: FailureKind
    message: str
    build_log: str = ""

    @property
    def infrastructure(self) -> bool:
        """Whether the farm failed (store, broker, a worker), not the kernel itself."""
        return self.kind in INFRASTRUCTURE_KINDS


class ArtifactMeta(Frozen):
    """Everything stored beside a binary. Its digest is checked before every load."""

    key: Key
    family: Name
    digest: str = Field(pattern=SHA256_HEX)
    size: NonNegInt64
    #: informational: the source index never takes it on trust (see farm.store.base)
    source_hash: str = Field(pattern=SHA256_HEX)
    build_log: LogText = ""
    host: ShortText = ""
    worker: ShortText = ""
    work_s: float = Field(default=0.0, ge=0.0, le=1e9)
    created_at: dt.datetime = Field(default_factory=lambda: dt.datetime.now(dt.UTC))
    #: how the store got the binary: ``compiled`` (and loaded) on this fingerprint by a
    #: farm writer; ``imported`` from a bundle, not loaded here yet; ``validated``,
    #: imported and then loaded on this fingerprint in an isolated process
    origin: Literal[Fate.COMPILED, "imported", "validated"] = Fate.COMPILED
    #: Ed25519 signature of :meth:`signed_bytes` by a writer's key ("" when unsigned),
    #: as ``v2:<base64>``; a bare base64 value is a version 1 signature (see below)
    signature: str = Field(default="", max_length=200)

    def signed_bytes(self, namespace: str) -> bytes:
        """What a (version 2) signature covers: the namespace, key, family, digest, size.

        The digest binds the binary; the key binds which kernel it may be served as; the
        namespace binds the device (its fingerprint), so a signed binary can be replayed
        neither under another kernel's key nor under another device's namespace.
        """
        from farm.core.signatures import signed_message

        return signed_message(namespace, str(self.key), self.family, self.digest, self.size)

    def signed_bytes_v1(self) -> bytes:
        """What a version 1 signature (farm before issue 19) covers: key, family, digest
        and size, *not* the namespace. Kept so that such a signature is recognised and
        refused by name (it does not say which device the binary is for), never
        mistaken for a forgery or, worse, for a signature that binds the device."""
        return canonical_json({"key": str(self.key), "family": self.family,
                               "digest": self.digest, "size": self.size}).encode()


class Artifact(BaseModel):
    """A compiled binary and its metadata."""

    model_config = ConfigDict(frozen=True)

    meta: ArtifactMeta
    binary: bytes

    @classmethod
    def create(cls, key: Key, family: str, binary: bytes, source_hash: str, *,
               build_log: str = "", host: str = "", worker: str = "",
               work_s: float = 0.0) -> Artifact:
        """Build an artifact, computing digest and size from the binary."""
        meta = ArtifactMeta(key=key, family=family, digest=sha256_hex(binary),
                            size=len(binary), source_hash=source_hash, build_log=build_log,
                            host=host, worker=worker, work_s=work_s)
        return cls(meta=meta, binary=binary)

    def verify(self) -> bool:
        """True when the binary matches its recorded size and digest."""
        return len(self.binary) == self.meta.size and sha256_hex(self.binary) == self.meta.digest
