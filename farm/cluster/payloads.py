"""Task payloads between a build client and the workers (JSON only, validated both ends).

A task carries data, never code: family names and parameters that the worker expands
with its own registry, plus the build id the client computed for each kernel so that a
worker running different kernel code refuses instead of storing under a wrong key.
A chunk may carry an application's programs too: that payload is the programs' own
(:class:`farm.programs.request.ChunkRequest`, a :class:`CompileRequest` with programs),
as the programs build on this client and this package never imports them.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import Field, ValidationError, field_validator, model_validator

from farm.core.errors import InputError, first_error
from farm.core.keys import Namespace
from farm.core.model import ArtifactId, Frozen, KernelFailure, ShortText
from farm.core.outcomes import Outcome
from farm.records.model import RequestedBy


class KernelRequest(Frozen):
    artifact: ArtifactId
    build_id: str = Field(pattern=r"^[0-9a-f]{8,64}$")


class CompileRequest(Frozen):
    """One chunk of kernels for one fingerprint (and, as a
    :class:`~farm.programs.request.ChunkRequest`, an application's programs).

    ``build``: the sending client's token, whose heartbeat key
    (``farm.core.keys.build_alive_key``) it keeps alive while it waits; a worker drops a
    chunk whose client is gone instead of compiling it for nobody. ``None`` (an older
    client): always built."""

    fingerprint: str
    kernels: list[KernelRequest] = Field(default_factory=list, max_length=1024)
    requested_by: RequestedBy | None = None
    build: str | None = Field(default=None, pattern=r"^[0-9a-f]{8,64}$")

    @model_validator(mode="after")
    def _names_something(self) -> CompileRequest:
        if not self.entries():
            raise ValueError("a chunk names no kernel and no program")
        return self

    def entries(self) -> int:
        """The kernels (and programs) the chunk names."""
        return len(self.kernels)

    @field_validator("fingerprint")
    @classmethod
    def _fingerprint(cls, value: str) -> str:
        Namespace.for_fingerprint(value)  # the one fingerprint rule
        return value


class PayloadError(InputError):
    """A task payload that does not validate. One line naming the field: it travels to
    the client through Celery's JSON as the exception's only argument, where a pydantic
    ``ValidationError`` (which cannot be rebuilt from JSON) arrived as an empty message."""


Request = TypeVar("Request", bound=CompileRequest)


def parse_request(payload: object, model: type[Request]) -> Request:
    """The validated ``model`` of a task's payload, or :class:`PayloadError` in one
    line (a worker parses every chunk as a ``farm.programs.request.ChunkRequest``)."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        where, msg = first_error(exc, "payload")
        raise PayloadError(f"task payload {where}: {' '.join(msg.split())}"[:500]) from None


class KernelReply(Frozen):
    id_hash: str = Field(max_length=64)
    key: str | None = Field(default=None, max_length=200)
    outcome: Outcome | None = None
    failure: KernelFailure | None = None
    work_s: float = Field(default=0.0, ge=0.0)
    worker: ShortText = ""
    host: ShortText = ""


class CompileReply(Frozen):
    """A chunk's outcome. Every kernel failure in ``results`` is the kernel's own (or, as
    ``infrastructure``, a chunk given back so often that it is given up): a worker that
    cannot build a chunk for reasons of its own gives the chunk back instead of replying
    (``farm.core.errors.InfrastructureError``). ``dropped``: why the chunk was not built
    at all (its client was gone); ``results`` is then empty, and a client that is in fact
    alive sends it again."""

    results: list[KernelReply]
    dropped: str = Field(default="", max_length=500)
