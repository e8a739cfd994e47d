"""A stored body or work-group record read exactly as its model reads it, without the
model where the standard library's reader decides alone (:mod:`farm.programs.headers`),
with it (pydantic imported then, and only then) where that reader leaves the case to it.

Apart from :mod:`farm.programs.headers` because the models (:mod:`farm.programs.body`,
:mod:`farm.programs.supplements`) import the formats' constants from there.
"""

from __future__ import annotations

from farm.programs.headers import BodyView, Undecided, read_body, read_record


def body_exactly(data: bytes, program: str, device: str) -> BodyView:
    """:func:`read_body`, the model deciding where this reader leaves it to the model
    (pydantic is imported then, and only then)."""
    try:
        return read_body(data, program, device)
    except Undecided:
        from farm.core.model import Key
        from farm.programs import body

        got = body.read_body(data, Key.parse(program), device)
        return BodyView(got.header.program, got.header.device, got.kernels, got.log,
                        got.binary)


def record_exactly(data: bytes, program: str, base: str, device: str,
                   kernels: frozenset[str]) -> dict[tuple[str, str], bytes]:
    """:func:`read_record`, the model deciding where this reader leaves it to the model
    (a recorded launch, or types the farm never writes)."""
    try:
        return read_record(data, program, base, device, kernels)
    except Undecided:
        from farm.core.model import Key
        from farm.programs.supplements import decode

        return decode(data, Key.parse(program), base, device, kernels).functions
