"""Task payloads between a build client and the workers (JSON only, validated both ends).

A task carries data, never code: family names and parameters that the worker expands
with its own registry, plus the build id the client computed for each kernel so that a
worker running different kernel code refuses instead of storing under a wrong key.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from farm.keys import Namespace
from farm.model import ArtifactId, Frozen, KernelFailure, Outcome, ShortText
from farm.records.model import RequestedBy

TASK_NAME = "farm.compile"


class KernelRequest(Frozen):
    artifact: ArtifactId
    build_id: str = Field(pattern=r"^[0-9a-f]{8,64}$")


class CompileRequest(Frozen):
    """One chunk of kernels for one fingerprint."""

    fingerprint: str
    kernels: list[KernelRequest] = Field(min_length=1, max_length=1024)
    requested_by: RequestedBy | None = None

    @field_validator("fingerprint")
    @classmethod
    def _fingerprint(cls, value: str) -> str:
        Namespace.for_fingerprint(value)  # the one fingerprint rule
        return value


class KernelReply(Frozen):
    id_hash: str = Field(max_length=64)
    key: str | None = Field(default=None, max_length=200)
    outcome: Outcome | None = None
    failure: KernelFailure | None = None
    work_s: float = Field(default=0.0, ge=0.0)
    worker: ShortText = ""
    host: ShortText = ""


class CompileReply(Frozen):
    results: list[KernelReply]
