"""Turning a validation error into the one line a person reads: file, line, field path
and what is wrong."""

from __future__ import annotations

import re
import types
from collections.abc import Sequence
from typing import Annotated, Union, get_args, get_origin

from pydantic import BaseModel

from farm.core.errors import ManifestError
from farm.manifest.lines import Loc
from farm.manifest.schema import Manifest


# ----------------------------------------------------------------------------------------
# Error messages: one line, file:line: field.path: what
# ----------------------------------------------------------------------------------------
def _one_line(text: str) -> str:
    return " ".join(text.split())


def _error(source: str, line: int | None, path: str, what: str) -> ManifestError:
    where = f"{source}:{line}" if line else source
    return ManifestError(_one_line(": ".join(p for p in (where, path, what) if p)))


_PYDANTIC_TAG = re.compile(r"^\[key\]$|^[\w-]+\[.*\]$")


def _clean_loc(loc: Sequence[str | int]) -> Loc:
    """Drop pydantic's own location segments (``[key]``, ``list[int]``...)."""
    return tuple(p for p in loc if isinstance(p, int) or not _PYDANTIC_TAG.match(p))


def _format_loc(loc: Loc) -> str:
    """``("kernels", 3, "params", "op")`` -> ``kernels[3].params.op``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part if re.fullmatch(r"[\w-]+", part) else f'"{part}"'
            out += f".{text}" if out else text
    return out


def _allowed_keys(loc: Loc) -> list[str]:
    """The keys of the table at ``loc`` (for 'unknown key' messages), if it is a model."""
    tp: object = Manifest
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if not isinstance(part, str) or part not in tp.model_fields:
                return []
            tp = tp.model_fields[part].annotation
        else:
            origin, args = get_origin(tp), get_args(tp)
            if origin is list and args:
                tp = args[0]
            elif origin is dict and len(args) == 2:
                tp = args[1]
            else:
                return []
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(tp.model_fields)
    return []


def _unwrap(tp: object) -> object:
    """``X | None`` -> ``X``; ``Annotated[X, ...]`` -> ``X``."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            rest = [a for a in get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                return tp
            tp = rest[0]
        else:
            return tp
