"""A proof's answer, in a module of its own: the quick path of a served application
reads the node's proofs (:mod:`farm.compilation.proofs`) without importing the proof's
child (:mod:`farm.compilation.validate`, which needs the device models and pydantic).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """A proof's answer: ``why`` "" when proven; ``definite`` False when nothing was
    decided (no child could start, or it did not answer in time)."""

    why: str = ""
    definite: bool = True

    @property
    def ok(self) -> bool:
        return not self.why
