"""The tuning task's payload and reply (JSON only, validated at both ends).

A task carries data: the key's spec (family name, problem, candidates: the worker
expands the family with its own registry and refuses another build of it), the
measurement policy and who asked. Its reply carries the stored result.
"""

from __future__ import annotations

from pydantic import Field, ValidationError, field_validator

from farm.core.errors import InputError, first_error
from farm.core.keys import Namespace
from farm.core.model import Frozen, ShortText
from farm.records.model import RequestedBy
from farm.tuning.keys import TuningSpec
from farm.tuning.model import MeasurePolicy, TuningResult


class TuneRequest(Frozen):
    """One tuning key for the workers of one fingerprint."""

    fingerprint: str
    spec: TuningSpec
    policy: MeasurePolicy = MeasurePolicy()
    #: measure even when the store holds a result (``farm tune --retune``)
    retune: bool = False
    requested_by: RequestedBy | None = None

    @field_validator("fingerprint")
    @classmethod
    def _fingerprint(cls, value: str) -> str:
        Namespace.for_fingerprint(value)  # the one fingerprint rule
        return value


class TuneReply(Frozen):
    """The key's result (``reused`` when the store held it already), or why it has none."""

    result: TuningResult | None = None
    reused: bool = False
    failure: ShortText = ""
    worker: ShortText = Field(default="", max_length=300)


class TunePayloadError(InputError):
    """A tuning payload that does not validate: one line naming the field."""


def parse_tune_request(payload: object) -> TuneRequest:
    try:
        return TuneRequest.model_validate(payload)
    except ValidationError as exc:
        where, msg = first_error(exc, "payload")
        raise TunePayloadError(f"tune payload {where}: {' '.join(msg.split())}"[:500]) \
            from None
