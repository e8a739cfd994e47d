"""The object format of the artifact store on MinIO (S3): one frame per artifact, and the
frame of a quarantined one. Kept apart from the store's requests (:mod:`farm.store.minio`)
because readers and tests take frames apart without a server.

Artifact object (``kernel-farm-artifact`` version 1)::

    b"KFARTIF1"                magic: format and version, 8 bytes
    uint32, big endian         length N of the metadata JSON
    N bytes                    ArtifactMeta as JSON (key, digest, size, build log, ...)
    the rest                   the binary

Quarantined object (``<namespace>/quarantine/<id>/<build>/<digest>``)::

    b"KFQUAR01"                magic
    uint32, big endian         length N of the note
    N bytes                    JSON: reason, at (ISO 8601)
    the rest                   the artifact's frame as it was stored (the evidence)

The short fields are also written as user metadata (``x-amz-meta-farm-*``), see
:func:`user_metadata`.
"""

from __future__ import annotations

import datetime as dt
import json
import struct
from urllib.parse import quote

#: typing.TYPE_CHECKING without importing typing: :func:`split_artifact` serves readers
#: that import no pydantic (farm.store.s3_get); the models load where frames become them
TYPE_CHECKING = False
if TYPE_CHECKING:
    from farm.core.model import Artifact
    from farm.store.base import Quarantined

MAGIC = b"KFARTIF1"
_LEN = struct.Struct(">I")
_HEADER = len(MAGIC) + _LEN.size
#: a quarantined artifact: this magic, uint32 length N, N bytes of JSON (reason, at),
#: then the artifact's own frame as it was stored
QUARANTINE_MAGIC = b"KFQUAR01"

#: user-metadata field names (sent as ``x-amz-meta-<name>``)
META_PREFIX = "x-amz-meta-"
M_DIGEST = "farm-digest"
_M_SIZE = "farm-size"
_M_BUILD = "farm-build-id"
M_SOURCE = "farm-source-hash"
_M_FAMILY = "farm-family"
_M_HOST = "farm-host"
_M_WORKER = "farm-worker"
_M_WORK = "farm-work-s"
_M_FORMAT = "farm-format"
#: longest free-text header value; keeps the headers far below S3's 2 KiB total
_MAX_HEADER_TEXT = 160



# -- object format ---------------------------------------------------------------------------
def encode_artifact(artifact: Artifact) -> bytes:
    """The object body: magic, length-prefixed metadata JSON, binary."""
    meta = artifact.meta.model_dump_json().encode("utf-8")
    return MAGIC + _LEN.pack(len(meta)) + meta + artifact.binary


def split_artifact(data: bytes) -> tuple[bytes, bytes] | None:
    """(metadata JSON, binary) of a whole frame; ``None`` for anything else."""
    if len(data) < _HEADER or not data.startswith(MAGIC):
        return None
    (length,) = _LEN.unpack_from(data, len(MAGIC))
    end = _HEADER + length
    if end > len(data):
        return None
    return data[_HEADER:end], data[end:]


def decode_artifact(data: bytes) -> Artifact | None:
    """Inverse of :func:`encode_artifact`; ``None`` for anything that is not a whole,
    well-formed frame (verification of the digest is the caller's)."""
    from pydantic import ValidationError

    from farm.core.model import Artifact, ArtifactMeta

    parts = split_artifact(data)
    if parts is None:
        return None
    try:
        meta = ArtifactMeta.model_validate_json(parts[0])
    except ValidationError:
        return None
    return Artifact(meta=meta, binary=parts[1])


def encode_quarantined(artifact: Artifact, reason: str, at: dt.datetime) -> bytes:
    note = json.dumps({"reason": reason, "at": at.isoformat()}).encode("utf-8")
    return QUARANTINE_MAGIC + _LEN.pack(len(note)) + note + encode_artifact(artifact)


def decode_quarantined(data: bytes) -> Quarantined | None:
    """Inverse of :func:`encode_quarantined`; ``None`` for anything else."""
    if len(data) < _HEADER or not data.startswith(QUARANTINE_MAGIC):
        return None
    (length,) = _LEN.unpack_from(data, len(QUARANTINE_MAGIC))
    try:
        note = json.loads(data[_HEADER:_HEADER + length].decode("utf-8"))
        at = dt.datetime.fromisoformat(str(note["at"]))
        reason = str(note["reason"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    artifact = decode_artifact(data[_HEADER + length:])
    if artifact is None:
        return None
    from farm.store.base import Quarantined

    return Quarantined(key=artifact.meta.key, artifact=artifact, reason=reason, at=at)


def header_text(value: str) -> str:
    """S3 header values must be printable US-ASCII: percent-encode the rest, cut it short."""
    return quote(value, safe=" !#$&'()*+,-./:;<=>?@[]^_`{|}~")[:_MAX_HEADER_TEXT]


def user_metadata(artifact: Artifact) -> dict[str, str]:
    meta = artifact.meta
    fields = {
        _M_FORMAT: MAGIC.decode("ascii"),
        M_DIGEST: meta.digest,
        _M_SIZE: str(meta.size),
        _M_BUILD: meta.key.build_id,
        M_SOURCE: header_text(meta.source_hash),
        _M_FAMILY: header_text(meta.family),
        _M_HOST: header_text(meta.host),
        _M_WORKER: header_text(meta.worker),
        _M_WORK: f"{meta.work_s:.6f}",
    }
    return {META_PREFIX + k: v for k, v in fields.items()}
